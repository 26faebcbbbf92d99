"""daskllm's defaults in dask.config (``daskllm.*`` keys), loaded from daskllm.yaml, and
per-computation overrides.

Overrides (``daskllm.compute(..., passes=...)``, a stream consumer planning its items with
its computation's settings) are local to the thread (context) that sets them: Dask's own
``dask.config.set`` changes the process-wide config, and two threads overriding at once
could each restore the other's value on exit, leaving the process with a computation's
settings for good.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import pathlib

import dask.config
import yaml

_DEFAULTS_FILE = pathlib.Path(__file__).with_name("daskllm.yaml")

with _DEFAULTS_FILE.open() as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)

# dotted key (without "daskllm.") -> value, for this context only
_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("daskllm_config_overrides", default={})


def _canonical(key: str) -> str:
    return key.replace("_", "-")


def get(key: str, default=None):
    """``dask.config.get("daskllm." + key)``, with this context's overrides applied."""
    value = dask.config.get(f"daskllm.{key}", default=default)
    over = _overrides.get()
    if not over:
        return value
    key = _canonical(key)
    for name, v in over.items():  # an override of this key, or of a subtree holding it
        if key == name:
            return v
        if key.startswith(name + ".") and isinstance(v, dict):
            node = v
            for part in key[len(name) + 1:].split("."):
                if not isinstance(node, dict) or part not in node:
                    break
                node = node[part]
            else:
                return node
    below = {name[len(key) + 1:]: v for name, v in over.items() if name.startswith(key + ".")}
    if below and isinstance(value, dict):  # overrides inside this subtree
        value = copy.deepcopy(value)
        for dotted, v in below.items():
            *path, last = dotted.split(".")
            node = value
            for part in path:
                node = node.setdefault(part, {})
            node[last] = v
    return value


@contextlib.contextmanager
def overriding(settings: dict):
    """Use ``settings`` (dotted keys without "daskllm.") in this context only."""
    token = _overrides.set({**_overrides.get(), **{_canonical(k): v for k, v in settings.items()}})
    try:
        yield
    finally:
        _overrides.reset(token)


def snapshot() -> str:
    """The whole daskllm config as this context sees it: a memo key for plans."""
    return repr((dask.config.get("daskllm"), sorted(_overrides.get().items())))
