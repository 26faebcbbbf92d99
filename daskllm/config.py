"""daskllm's defaults in dask.config (``daskllm.*`` keys), loaded from daskllm.yaml."""

from __future__ import annotations

import pathlib

import dask.config
import yaml

_DEFAULTS_FILE = pathlib.Path(__file__).with_name("daskllm.yaml")

with _DEFAULTS_FILE.open() as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str, default=None):
    """``dask.config.get("daskllm." + key)``."""
    return dask.config.get(f"daskllm.{key}", default=default)
