"""Retrieval: the embed engine, rerankers, vector indexes, and indexes sharded across workers."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from distributed import get_task_stream

from daskllm.corpus import stdlib_docs
from daskllm.engines import RequestError
from daskllm.engines.embedder import EmbedEngine
from daskllm.engines.reranker import BiEncoderReranker
from daskllm.index import VectorIndex, merge_hits
from daskllm.datasets import stdlib_questions
from daskllm.retrieval import ShardedIndex
from daskllm.worker import embed, rerank

DOCS = [
    "json.load reads a JSON document from a file object and returns Python objects.",
    "csv.reader iterates over lines of a CSV file and yields lists of strings.",
    "re.match tries to apply a regular expression pattern at the start of a string.",
    "os.walk generates the file names in a directory tree, top-down or bottom-up.",
    "hashlib.sha256 returns a hash object computing the SHA-256 digest of bytes.",
]


def corpus_text(row) -> str:
    # The opening of the docstring: what retrieval needs, and quick to embed.
    return f"{row.qualname}{row.signature}: {row.doc[:300]}"


@pytest.fixture(scope="module")
def embedder():
    with EmbedEngine() as engine:
        yield engine


# --- the embed engine ---------------------------------------------------------------------


def test_embeddings_match_sentence_transformers(embedder):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(embedder.path), device="cpu").encode(DOCS, normalize_embeddings=True)
    ours = embedder.embed(DOCS)
    assert ours.shape == (len(DOCS), 384) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)


@pytest.mark.bits
def test_an_embedding_does_not_depend_on_its_batch(embedder):
    texts = DOCS + [f"filler text {i} " * (i % 9 + 1) for i in range(40)]
    together = embedder.embed(texts)
    for i in (0, 3, 17, 44):
        assert np.array_equal(embedder.embed([texts[i]])[0], together[i])


@pytest.mark.bits
def test_concurrent_requests_share_batches(embedder):
    before = embedder.stats()
    texts = [f"request {i}: how do I parse {i} dates?" for i in range(24)]
    expected = embedder.embed(texts)
    out: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(24)

    def one(i: int):
        barrier.wait()
        out[i] = embedder.embed([texts[i]])[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(np.array_equal(out[i], expected[i]) for i in range(24))
    after = embedder.stats()
    assert after.requests - before.requests == 25
    assert after.batches - before.batches < 25  # some requests rode together


def test_embed_rejects_non_text_rows_by_position(embedder):
    with pytest.raises(RequestError, match="text 1 is a int"):
        embedder.submit(["ok", 5])
    assert embedder.embed([]).shape == (0, 384)
    assert embedder.embed(["still serving"]).shape == (1, 384)


# --- rerank ------------------------------------------------------------------------------------


def test_bi_encoder_reranker_puts_the_relevant_document_first(embedder):
    reranker = BiEncoderReranker(embedder=embedder)
    ranking = reranker.rerank("How do I read a JSON file?", DOCS, k=3)
    assert ranking[0][0] == 0 and len(ranking) == 3
    vectors = embedder.embed(["How do I read a JSON file?", *DOCS]).astype(np.float64)
    np.testing.assert_allclose(reranker.scores("How do I read a JSON file?", DOCS), vectors[1:] @ vectors[0])
    assert [i for i, _ in reranker.rerank("walk a directory tree", DOCS)][0] == 3
    with pytest.raises(RequestError, match="doc 2 is a NoneType"):
        reranker.submit("q", ["a", "b", None])


# --- a local vector index --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_corpus(embedder, stdlib_corpus):
    texts = [corpus_text(r) for r in stdlib_docs(limit=600).itertuples()]
    return texts, embedder.embed(texts)


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_index_kinds_find_their_documents(small_corpus, kind):
    texts, vectors = small_corpus
    index = VectorIndex(384, kind=kind, name="stdlib", nlist=16)
    index.add(vectors, texts=texts)
    hits = index.search(vectors[:20], k=3)
    assert sum(h[0].id == i for i, h in enumerate(hits)) >= 18
    assert hits[0][0].text == texts[hits[0][0].id]


def test_equal_scores_rank_by_id_and_k_beyond_the_index_is_an_error():
    index = VectorIndex(4, name="ties")
    v = np.array([1.0, 0, 0, 0], dtype=np.float32)
    index.add(np.stack([v * 0.5] + [v] * 6), ids=[9, 7, 3, 5, 1, 8, 2])
    hits = index.search(v, k=3)[0]
    assert [h.id for h in hits] == [1, 2, 3]  # six equal scores: lowest ids first
    with pytest.raises(ValueError, match="index 'ties': k=8 is larger than the index"):
        index.search(v, k=8)
    with pytest.raises(ValueError, match="index 'ties': query vectors must have dimension 4"):
        index.search(np.ones(3), k=1)
    with pytest.raises(ValueError, match="index 'ties': ids already present"):
        index.add(v, ids=[7])


def test_index_save_load_and_incremental_ingest(embedder, tmp_path):
    index = VectorIndex(384, name="docs")
    index.add(embedder.embed(DOCS[:3]), texts=DOCS[:3])
    index.add(embedder.embed(DOCS[3:]), texts=DOCS[3:])  # ids continue: 3, 4
    assert list(index.ids) == [0, 1, 2, 3, 4]
    queries = embedder.embed(["regular expression", "sha digest"])
    before = index.search(queries, k=2)
    loaded = VectorIndex.load(index.save(tmp_path / "docs"))
    assert loaded.search(queries, k=2) == before
    assert before[0][0].text == DOCS[2] and before[1][0].id == 4
    with pytest.raises(FileNotFoundError, match="no saved index"):
        VectorIndex.load(tmp_path / "nothing")


def test_merge_hits_equals_one_flat_index():
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(300, 16)).astype(np.float32)
    whole = VectorIndex(16)
    whole.add(vectors)
    shards = [VectorIndex(16) for _ in range(3)]
    for s, shard in enumerate(shards):
        rows = np.arange(s, 300, 3)
        shard.add(vectors[rows], ids=rows)
    queries = rng.normal(size=(25, 16)).astype(np.float32)
    assert merge_hits([s.search(queries, 10) for s in shards], 10) == whole.search(queries, 10)


# --- sharded across a multi-process cluster ---------------------------------------------------------


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir, stdlib_corpus):
    with llm_cluster(n_workers=2, threads_per_worker=4, engine_options={"kv_cache_tokens": 1024}) as client:
        yield client


@pytest.fixture(scope="module")
def corpus(stdlib_corpus):
    return stdlib_docs(limit=1200)


@pytest.fixture(scope="module")
def stdlib_index(client, corpus):
    index = ShardedIndex.create(client, "stdlib")
    half = len(corpus) // 2
    index.ingest([corpus_text(r) for r in corpus.iloc[:half].itertuples()], corpus.id.iloc[:half])
    index.ingest([corpus_text(r) for r in corpus.iloc[half:].itertuples()], corpus.id.iloc[half:])  # incremental
    yield index
    index.drop()


def test_shards_live_on_different_workers_and_search_runs_where_they_are(client, stdlib_index, corpus):
    assert len(set(stdlib_index.workers)) == 2
    assert stdlib_index.sizes == [len(corpus) // 2, len(corpus) - len(corpus) // 2]
    with get_task_stream(client) as stream:
        per_shard, merged = stdlib_index.search_futures(["read a JSON document"], 3)
        client.gather(merged)
    ran_on = {t["key"]: t["worker"] for t in stream.data}
    assert [ran_on[f.key] for f in per_shard] == stdlib_index.workers


def test_sharded_search_equals_one_flat_index(client, stdlib_index, corpus):
    texts = [corpus_text(r) for r in corpus.itertuples()]
    chunks = [texts[i:i + 100] for i in range(0, len(texts), 100)]
    vectors = np.concatenate(client.gather(client.map(embed, ["all-MiniLM-L6-v2"] * len(chunks), chunks)))
    flat = VectorIndex(384)
    flat.add(vectors, ids=corpus.id, texts=texts)
    queries = ["read a JSON document", "compile a regular expression", "open a socket", "format a date"]
    sharded = stdlib_index.search(queries, k=10)
    assert sharded == flat.search(client.submit(embed, "all-MiniLM-L6-v2", queries).result(), k=10)


def test_retrieval_quality_on_docstring_first_sentences(stdlib_index, corpus):
    questions = stdlib_questions(1000, seed=1)
    questions = questions[questions.id.isin(corpus.id)]
    assert len(questions) >= 100
    hits = stdlib_index.search([q.split(": ", 1)[-1] for q in questions.question], k=5)
    recall_at_5 = np.mean([qid in [h.id for h in row] for qid, row in zip(questions.id, hits)])
    assert recall_at_5 >= 0.8


def test_search_errors_name_the_index_the_query_and_the_shard(client, stdlib_index):
    results = stdlib_index.search(["json", 42, "csv"], k=2, errors="keep")
    assert isinstance(results[1], ValueError) and "query 1 is a int" in str(results[1])
    assert len(results[0]) == 2 and len(results[2]) == 2
    with pytest.raises(ValueError, match="k=100000 is larger than the index"):
        stdlib_index.search(["json"], k=100_000)
    ghost = ShardedIndex(client, "ghost", stdlib_index.config, stdlib_index.workers, sizes=[1, 1])
    with pytest.raises(LookupError, match=r"index 'ghost' shard [01] is not on worker"):
        ghost.search(["json"], k=1)


def test_ingest_rejects_non_text_rows_and_empty_corpora(client):
    index = ShardedIndex.create(client, "bad-rows", shards=1)
    with pytest.raises(ValueError, match="index 'bad-rows': row with id 1 is a NoneType"):
        index.ingest(["fine", None, "also fine"])
    with pytest.raises(ValueError, match="empty corpus"):
        index.ingest([])
    with pytest.raises(ValueError, match="already exists"):
        ShardedIndex.create(client, "bad-rows")
    index.drop()


def test_ingest_a_dataframe_column_and_save_load(client, tmp_path, stdlib_corpus):
    from daskllm.corpus import stdlib_docs_ddf

    ddf = stdlib_docs_ddf(npartitions=4).head(300, npartitions=-1, compute=False)
    index = ShardedIndex.create(client, "from-ddf").ingest_dataframe(ddf, "first_sentence", id_column="id")
    assert index.ntotal == 300
    queries = ["Return the absolute value of the argument."]
    before = index.search(queries, k=3)
    path = index.save(tmp_path / "saved")
    index.drop()
    loaded = ShardedIndex.load(client, path)
    assert loaded.search(queries, k=3) == before
    loaded.drop()


def test_rerank_task_on_the_cluster(client):
    ranking = client.submit(rerank, "all-MiniLM-L6-v2", "hash some bytes", DOCS, 2).result()
    assert ranking[0][0] == 4 and len(ranking) == 2


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, embedder):
    """A small cross-encoder with random weights and MiniLM's tokenizer (no reranker weights exist here)."""
    import shutil

    import torch
    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, num_labels=1)
    BertForSequenceClassification(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(embedder.path / name, path / name)
    return path


def test_any_cross_encoder_directory_scores_pairs_jointly(cross_encoder_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from daskllm.engines.reranker import CrossEncoderReranker, load_reranker

    reranker = load_reranker(str(cross_encoder_dir))
    assert isinstance(reranker, CrossEncoderReranker)
    try:
        query = "How do I read a JSON file?"
        scores = reranker.scores(query, DOCS)
        tokenizer = AutoTokenizer.from_pretrained(cross_encoder_dir)
        model = AutoModelForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
        with torch.no_grad():
            expected = model(**tokenizer([query] * len(DOCS), DOCS, padding=True, return_tensors="pt")).logits[:, 0]
        np.testing.assert_allclose(scores, expected.numpy(), atol=1e-5)
        ranking = reranker.rerank(query, DOCS, k=2)
        assert [i for i, _ in ranking] == sorted(range(len(DOCS)), key=lambda i: (-scores[i], i))[:2]
        with pytest.raises(RequestError, match="query must be a str"):
            reranker.submit(None, DOCS)
    finally:
        reranker.close()
