"""Calibrations remembered on disk, per model, engine numerics and machine: what
``daskllm.dataframe.calibrate()`` measured (per-token costs, a table operator's overhead), so
that a new cluster on the same machine previews times at once, without calibrating.

A calibration is kept under its :class:`Identity`:

* the model's files: the digest the result store computes of the model directory
  (:meth:`daskllm.worker.store.ResultStore.model_identity`), so a changed model never reuses
  an old one's costs;
* the engine's numerics (backend, dtype, device: :func:`daskllm.worker.store.numerics`);
* the machine: the CPU's model, its logical cores and the engine's torch threads (the
  threads are the cores shared among the machine's workers), or a GPU's name. Not the
  hostname: the records live in the machine's own cache directory, where it adds nothing,
  and a container or VM gets a new hostname at each start, which would forget them all;
  where the directory is shared, machines of the same hardware compute at the same speed.

The workers write and read the records (each knows its engines' numerics; the client may be
on another machine): one small JSON file per identity in ``daskllm.calibrations.path``
(default: ``<daskllm cache dir>/calibrations``). ``calibrate()`` replaces a record;
``daskllm cache clear --calibrations`` (or deleting the directory) forgets them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import pathlib
import platform
import time
import weakref
from dataclasses import asdict, dataclass

import torch

from daskllm import config
from daskllm.engines import compute
from daskllm.models import cache_dir
from daskllm.worker.host import PLUGIN_NAME
from daskllm.worker.store import ResultStore, numerics, open_store

logger = logging.getLogger(__name__)

_FORMAT = 1  # bump when a record's fields change meaning: older records are then never read

# model -> the calibration this process's cluster measured (calibrate() sends it to every worker)
CURRENT: dict[str, dict] = {}
_identities: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> Identity: fixed once loaded


@dataclass(frozen=True, slots=True)
class Identity:
    """What a calibration is valid for."""

    model_digest: str
    numerics: str
    machine: str

    def key(self) -> str:
        return hashlib.sha256(json.dumps([_FORMAT, *asdict(self).values()]).encode()).hexdigest()


def calibrations_path() -> pathlib.Path:
    configured = config.get("calibrations.path")
    return pathlib.Path(configured).expanduser() if configured else cache_dir() / "calibrations"


def record_file(identity: Identity, model: str, directory: pathlib.Path | None = None) -> pathlib.Path:
    directory = directory if directory is not None else calibrations_path()
    return directory / f"{pathlib.Path(model).name}-{identity.key()[:24]}.json"


def remember(model: str, identity: Identity, costs: dict, directory: pathlib.Path | None = None) -> dict:
    """Write ``costs`` (per-token seconds, overheads) as the calibration of ``model`` under
    ``identity``, replacing an earlier one; returns the record."""
    record = {**costs, "model": model, "measured_at": time.time(), **asdict(identity)}
    path = record_file(identity, model, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)
    return record


def recall(model: str, identity: Identity, directory: pathlib.Path | None = None) -> dict | None:
    """The calibration remembered for ``model`` under exactly ``identity``, or None."""
    try:
        record = json.loads(record_file(identity, model, directory).read_text())
    except (OSError, ValueError):
        return None
    return record if all(record.get(k) == v for k, v in asdict(identity).items()) else None


def forget_all(directory: pathlib.Path | None = None) -> int:
    """Delete every remembered calibration; how many there were."""
    directory = directory if directory is not None else calibrations_path()
    files = list(directory.glob("*.json")) if directory.is_dir() else []
    for path in files:
        path.unlink(missing_ok=True)
    return len(files)


def count(directory: pathlib.Path | None = None) -> int:
    directory = directory if directory is not None else calibrations_path()
    return sum(1 for _ in directory.glob("*.json")) if directory.is_dir() else 0


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(engine) -> str:
    """The hardware an engine's speed depends on besides its numerics."""
    device = getattr(getattr(engine, "model", None), "device", None) or getattr(engine, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    threads = compute.run(torch.get_num_threads)  # the compute thread's: OpenMP keeps it per thread
    return f"{cpu_model()}, {os.cpu_count()} cores, {threads} torch thread{'' if threads == 1 else 's'}"


def identity_of(engine, store: ResultStore | None = None) -> Identity:
    identity = _identities.get(engine)
    if identity is None:
        # The result store's index remembers model digests by the files' sizes and times, so the
        # model's bytes are read once per machine; it is opened for that even where results are off.
        store = store if store is not None else open_store(enabled=True)
        identity = _identities[engine] = Identity(store.loaded_identity(engine), numerics(engine), machine(engine))
    return identity


# --- what a client runs on every worker (client.run) ---------------------------------------------


async def remember_on_worker(model: str, costs: dict, dask_worker=None) -> bool:
    """Keep ``costs`` as this cluster's calibration of ``model`` here, and on disk under this
    worker's engine identity; False if this worker holds no engine for ``model``."""
    engine = await _loaded_engine(dask_worker, model)
    if engine is None:
        return False
    CURRENT[model] = dict(costs)
    try:
        await asyncio.to_thread(lambda: remember(model, identity_of(engine), costs))
    except Exception as exc:  # noqa: BLE001 - a cache: the cluster's calibration stands without it
        logger.warning("daskllm: could not remember the calibration of %s: %s", model, exc)
    return True


async def calibrations(dask_worker=None) -> dict[str, dict]:
    """Per model this worker serves: this cluster's calibration (``remembered: False``), else the
    one remembered for its engine's identity (``remembered: True``); none for a model with
    neither. Waits for engines still loading: the identity is the loaded engine's."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return {}
    await plugin.loaded()
    engines = dict(plugin.engines.get("llm", {}))

    def lookup() -> dict[str, dict]:
        found = {}
        for name, engine in engines.items():
            if name in CURRENT:
                found[name] = {**CURRENT[name], "remembered": False}
            elif (record := recall(name, identity_of(engine))) is not None:
                found[name] = {**record, "remembered": True}
        return found

    try:
        return await asyncio.to_thread(lookup)  # a first digest of a model reads its files
    except Exception as exc:  # noqa: BLE001 - no remembered calibration: the preview says so
        logger.warning("daskllm: could not look up remembered calibrations: %s", exc)
        return {name: {**CURRENT[name], "remembered": False} for name in engines if name in CURRENT}


async def _loaded_engine(dask_worker, model: str):
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return None
    await plugin.loaded()
    return plugin.resident(model)
