"""Helpers shared by the cluster tests."""

from __future__ import annotations

from daskllm.placement import set_policy  # noqa: F401 (tests import it from here)
from daskllm.runtime.control import cold_start  # noqa: F401 (tests import it from here)
