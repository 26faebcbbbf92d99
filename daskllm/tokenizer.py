"""A byte-level BPE tokenizer trained locally, so the project needs no model hub.

The training corpus is the running Python's standard library source: it is on
every machine, needs no download, and is deterministic for a given Python build.
``corpus_digest()`` identifies it, so model caches built on another Python
version never get mixed up with ours.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sysconfig

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Listed first to the trainer, so they take ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

CORPUS_BYTES = 4_000_000
_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages"})

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens, known without building the tokenizer."""
    return {token: index for index, token in enumerate(SPECIAL_TOKENS)}


def _corpus_files() -> list[pathlib.Path]:
    stdlib = pathlib.Path(sysconfig.get_path("stdlib"))
    files = []
    for path in stdlib.rglob("*.py"):
        relative_dirs = path.relative_to(stdlib).parts[:-1]
        if _SKIPPED_DIRS.isdisjoint(relative_dirs):
            files.append(path)
    # Sort by the relative path as a string: rglob order depends on the filesystem.
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


@functools.cache
def corpus_text() -> str:
    """About CORPUS_BYTES of stdlib source, always the same files in the same order."""
    parts: list[str] = []
    size = 0
    for path in _corpus_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= CORPUS_BYTES:
            break
    return "".join(parts)


@functools.cache
def corpus_digest() -> str:
    """sha256 of the training corpus; part of every model cache key."""
    return hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()


def _corpus_chunks(chunk_chars: int = 64_000):
    text = corpus_text()
    for start in range(0, len(text), chunk_chars):
        yield text[start : start + chunk_chars]


def build_tokenizer(dest: pathlib.Path, vocab_size: int = 16384) -> None:
    """Train the tokenizer and save it as a Hugging Face fast tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    ids = special_token_ids()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_chunks(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, ids[BOS_TOKEN])],
    )
    for token, index in ids.items():
        assert tokenizer.token_to_id(token) == index, (token, tokenizer.token_to_id(token))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=1 << 30,
        # Decoding must give back the exact text, spaces before punctuation included.
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(dest)
