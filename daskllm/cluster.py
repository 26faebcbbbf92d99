"""LocalLLMCluster: a LocalCluster whose workers keep LLM engines resident.

With GPUs (found through NVML) there is one worker per GPU, each seeing only its own
device through ``CUDA_VISIBLE_DEVICES``, as dask-cuda does; a model served with tensor
parallelism over N GPUs gets one worker per N GPUs, each seeing its N. More workers than
GPUs share them, splitting each GPU's memory between their engines. Without GPUs (or
without NVML) the workers are CPU processes sharing the machine's cores.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

import dask
from dask.utils import parse_timedelta
from distributed import LocalCluster
from distributed.core import Status
from distributed.deploy.cluster import Cluster

from daskllm import config

from daskllm.adaptive import AdaptiveTarget
from daskllm.dashboard import DashboardPlugin
from daskllm.engines import EngineSpec, runs_vllm, sizing
from daskllm.engines.vllm import CPU_BLOCK_MULTIPLE
from daskllm.ledger import UsageLedger
from daskllm.models import DEFAULT_EMBEDDING_MODEL, resolve
from daskllm.placement import PlacementPlugin
from daskllm.prompts import tokenizer_for
from daskllm.streaming import StreamJanitor
from daskllm.worker import EngineHost, default_num_threads

logger = logging.getLogger(__name__)

# The dashboard (Dask's pages and ours) has no authentication: by default only this machine
# reaches it. Dask's own default, ":8787", listens on every interface.
DASHBOARD_ADDRESS = "127.0.0.1:8787"

# Dask starts workers with MALLOC_TRIM_THRESHOLD_=65536, which makes torch's many short-lived
# buffers slow (measured: prefill and embedding 30-50% slower). A nanny reads this when it is
# created: at start-up, and for every worker scale() or adapt() adds later.
NO_MALLOC_TRIM = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


# What a CPU worker imports before it can load its engines: about 5 s of CPU per worker
# (measured), paid once by a forkserver that every worker (and every restart) forks from.
WORKER_IMPORTS = ("distributed", "daskllm", "daskllm.worker", "daskllm.engines.torch_engine",
                  "daskllm.engines.embedder", "daskllm.engines.reranker", "transformers.modeling_utils",
                  "transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama",
                  "transformers.models.bert.modeling_bert")


def fork_workers_from_preloaded_server() -> None:
    """Dask's nannies in this process start workers from a forkserver that has imported
    WORKER_IMPORTS, instead of spawning interpreters that each import them again (Dask's own
    test suite does the same for distributed). Each worker is still a process of its own.

    The server starts with the first worker and keeps the environment it had then: clusters
    pass their workers the current one (LocalLLMCluster's ``env``). Not for GPU workers: CUDA
    and vLLM's engine processes want fresh interpreters."""
    import multiprocessing
    import multiprocessing.forkserver
    import signal

    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    get_mp_context()  # distributed's own preload list, set once: replaced by ours
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_IMPORTS))
    # The server starts now, ignoring SIGINT and SIGTERM as the workers it forks will: a signal
    # to the whole process group (Ctrl-C, a supervisor's stop) is for the program, which closes
    # its cluster. A worker would die of it (SIGINT: a traceback each), and the server's death
    # looks like every worker's to their nannies, which would restart them.
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def warm_tokenizers(models: Iterable[str]) -> None:
    """Load this process's tokenizers for ``models`` in a background thread. Planning a
    model's first call tokenizes its prompts, and loading a tokenizer first imports
    transformers (seconds of CPU); the workers take as long to start, in other processes.
    A failure is left for that first call to raise."""

    def load() -> None:
        for model in models:
            try:
                tokenizer_for(model)
            except Exception:  # noqa: BLE001 - reported by the call that needs it
                return

    threading.Thread(target=load, daemon=True, name="daskllm-warm-tokenizers").start()


def discover_gpus() -> list[str]:
    """GPU ids this process may use: CUDA_VISIBLE_DEVICES if set, else every device NVML sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no NVML library, no GPU: CPU workers
        return []


def settings_for_vllm(on_cpu: bool) -> None:
    """What vLLM engines need of the whole cluster, set in this process's config (which the
    nannies give their workers): workers that may start child processes (vLLM's engine core)
    and, on CPU, KV blocks of a multiple of 32 tokens, the one block size that the engines,
    the planner and the placement plugin all hash prompts with."""
    dask.config.set({"distributed.worker.daemon": False})
    block = config.get("engine.block-size")
    if on_cpu and block % CPU_BLOCK_MULTIPLE:
        logger.info("daskllm.engine.block-size %d -> %d: vLLM's CPU build keeps blocks of a multiple of %d tokens",
                    block, CPU_BLOCK_MULTIPLE, CPU_BLOCK_MULTIPLE)
        dask.config.set({"daskllm.engine.block-size": CPU_BLOCK_MULTIPLE})


def scheduler_plugins(placement: str | None = None) -> list:
    """The scheduler plugins of a daskllm cluster (LocalLLMCluster's, and the ``dask llm
    scheduler`` preload's): placement (none with ``"off"``), stream clean-up, the dashboard's
    LLM page, the adaptive target and the usage ledger."""
    return ([StreamJanitor(), DashboardPlugin(), AdaptiveTarget(), UsageLedger()]
            + ([PlacementPlugin(placement)] if placement != "off" else []))


class LocalLLMCluster(LocalCluster):
    """A local Dask cluster with resident engines on every worker.

    ``models`` (LLMs; default: ``daskllm.model``, smollm2), ``embedders`` and ``rerankers`` are
    recipe or packaged model names (``"smollm2"``, ``"tiny"``, ``"all-MiniLM-L6-v2"``), local
    Hugging Face model directories,
    dicts or :class:`~daskllm.engines.EngineSpec` objects. By default every worker also holds
    the MiniLM embedder and a bi-encoder reranker sharing its weights. The scheduler runs the
    :class:`~daskllm.placement.PlacementPlugin` with ``placement`` (a policy name; default
    from ``daskllm.placement.policy``), the :class:`~daskllm.streaming.StreamJanitor`, the
    :class:`~daskllm.adaptive.AdaptiveTarget` (``cluster.adapt()`` sees engine work) and the
    dashboard's LLM page (:class:`~daskllm.dashboard.DashboardPlugin`); the dashboard listens on
    ``127.0.0.1:8787`` unless ``dashboard_address`` says otherwise (it has no authentication), and
    the scheduler on 127.0.0.1 unless ``host`` does (LocalCluster's default). Every model is
    resolved (and built, for a recipe, once) before any worker starts, so a bad name fails
    here with a clear error rather than in every worker; the LLMs' tokenizers, which planning
    needs in this process, load while the workers start.

    ``backend`` (torch, vllm, auto) applies to specs that name none. With GPUs each worker
    gets ``gpus_per_worker`` of them (default: the largest ``tensor_parallel_size`` among
    the specs' options, else 1) through ``CUDA_VISIBLE_DEVICES``. ``workers_per_gpu`` workers
    share each GPU (group) (default: as many as ``n_workers`` needs, else 1), each worker's LLM
    engines taking ``daskllm.engine.gpu-memory-utilization / workers_per_gpu`` of its memory.
    """

    def __init__(self, models: Iterable[str | Mapping | EngineSpec] | None = None, *,
                 embedders: Iterable[str | Mapping | EngineSpec] = (DEFAULT_EMBEDDING_MODEL,),
                 rerankers: Iterable[str | Mapping | EngineSpec] = (DEFAULT_EMBEDDING_MODEL,),
                 n_workers: int | None = None, threads_per_worker: int = 4,
                 gpus: Iterable[str] | str | None = "auto", engine_options: Mapping | None = None,
                 placement: str | None = None, backend: str | None = None, gpus_per_worker: int | None = None,
                 workers_per_gpu: int | None = None, **kwargs):
        placement = placement or config.get("placement.policy")
        models = [config.get("model")] if models is None else models
        # backend= is the default for specs that name none (else daskllm.engine.backend on the worker)
        self.engine_specs = EngineSpec.expand(models, embedders, rerankers, backend=backend)
        for spec in self.engine_specs:
            resolve(spec.model)
        warm_tokenizers(dict.fromkeys(s.model for s in self.engine_specs if s.kind == "llm"))
        self.gpus = discover_gpus() if gpus == "auto" else list(gpus or [])
        # A tensor-parallel model needs its GPUs in one worker.
        self.gpus_per_worker = gpus_per_worker or max(int(s.options.get("tensor_parallel_size", 1))
                                                      for s in self.engine_specs)
        if self.gpus:
            groups = len(self.gpus) // self.gpus_per_worker
            # Workers sharing a GPU (group) split its memory: fixed now, so a worker started
            # later (a restart, a scale-up) takes the share it was planned with.
            self.workers_per_gpu = workers_per_gpu or (1 if n_workers is None else max(1, -(-n_workers // max(1, groups))))
            most = groups * self.workers_per_gpu
            n_workers = most if n_workers is None else n_workers
            if not 0 < n_workers <= most:
                raise ValueError(f"n_workers={n_workers} workers of {self.gpus_per_worker} GPU(s) each do not fit "
                                 f"the visible GPUs {self.gpus}: {self.workers_per_gpu} worker(s) per "
                                 f"{self.gpus_per_worker} GPU(s) (workers_per_gpu= shares a GPU between more)")
            # vLLM runs its engine core in a child process, which daemonic workers may not
            # have. The nanny reads this when it (re)starts a worker, so it stays set.
            dask.config.set({"distributed.worker.daemon": False})
        vllm_workers = runs_vllm(self.engine_specs)
        if vllm_workers:
            settings_for_vllm(on_cpu=not self.gpus)
        n_workers = 1 if n_workers is None else n_workers
        defaults = dict(engine_options or {})
        if not self.gpus:
            defaults.setdefault("num_threads", default_num_threads(n_workers))
        kwargs.setdefault("processes", True)
        vllm_on_cpu = not self.gpus and vllm_workers
        # One worker leaves its engine unbound: measured faster (its Dask and Python threads share
        # the cores with the engine's); several are faster each on its own cores (docs/vllm.md).
        self.cpu_shares = n_workers if vllm_on_cpu and kwargs["processes"] and n_workers > 1 \
            and config.get("engine.cpu-bind") and config.get("engine.cpu-cores") is None else 0
        if kwargs["processes"] and not self.gpus:
            fork_workers_from_preloaded_server()
            # A forked worker has the server's environment: give it this process's, as a spawned one gets.
            kwargs["env"] = {**os.environ, **(kwargs.get("env") or {})}
        kwargs.setdefault("dashboard_address", DASHBOARD_ADDRESS)  # an address given (or None) is used as is
        # Engine threads compute; Dask threads mostly wait on the engine, so a few per worker
        # let concurrent tasks feed one batch.
        # Start with no workers, then scale: LocalCluster's own start-up bypasses
        # new_worker_spec, which is where each GPU worker gets its device.
        scheduler_kwargs = dict(kwargs.pop("scheduler_kwargs", None) or {})
        scheduler_kwargs.setdefault("plugins", scheduler_plugins(placement))
        super().__init__(n_workers=0, threads_per_worker=threads_per_worker,
                         scheduler_kwargs=scheduler_kwargs, plugins={EngineHost(self.engine_specs, **defaults)},
                         **kwargs)
        self.scale(n_workers)
        if not self.asynchronous:
            self.sync(self._correct_state)

    async def _correct_state_internal(self) -> None:
        with dask.config.set(NO_MALLOC_TRIM):  # where SpecCluster creates nannies
            await super()._correct_state_internal()

    def new_worker_spec(self):
        if not self.gpus:
            return self._with_cores(super().new_worker_spec())
        # A worker's name is its devices ("0", "2,3"), with "#k" for the k-th sharing them.
        taken = Counter(str(name).split("#")[0] for name in self.worker_spec)
        groups = [",".join(self.gpus[i:i + self.gpus_per_worker])
                  for i in range(0, len(self.gpus) - self.gpus_per_worker + 1, self.gpus_per_worker)]
        devices = min(groups, key=lambda g: (taken[g], groups.index(g)))
        if taken[devices] >= self.workers_per_gpu:
            raise ValueError(f"cannot start another worker of {self.gpus_per_worker} GPU(s): GPUs {self.gpus} "
                             f"are visible, each group taken by {self.workers_per_gpu} worker(s)")
        spec = copy.deepcopy(self.new_spec)
        spec["options"]["env"] = {**spec["options"].get("env", {}), "CUDA_VISIBLE_DEVICES": devices}
        if self.workers_per_gpu > 1:
            # The nanny sets this config in the worker (its top-level keys replace this
            # process's, so the whole daskllm section): its LLM engines take their share.
            share = sizing.gpu_memory_utilization() / self.workers_per_gpu
            daskllm_config = dask.config.merge(dask.config.get("daskllm"),
                                               {"engine": {"gpu-memory-utilization": share}})
            spec["options"]["config"] = {**spec["options"].get("config", {}), "daskllm": daskllm_config}
        used = {str(name) for name in self.worker_spec}
        name = devices if self.workers_per_gpu == 1 else next(
            f"{devices}#{k}" for k in range(self.workers_per_gpu + len(used)) if f"{devices}#{k}" not in used)
        return {name: spec}

    def _with_cores(self, specs: dict) -> dict:
        """A CPU worker's spec with its engine's cores (``daskllm.engine.cpu-cores``, in its
        config): worker i of n takes the i-th n-th of this process's cores (a restarted
        worker keeps its slot's). Fewer cores than workers: none bound."""
        cores = sorted(os.sched_getaffinity(0))
        share = len(cores) // self.cpu_shares if self.cpu_shares else 0
        if not share:
            return specs
        out = {}
        for name, spec in specs.items():
            i = name if isinstance(name, int) else len(self.worker_spec)
            mine = cores[(i % self.cpu_shares) * share:(i % self.cpu_shares + 1) * share]
            spec = copy.deepcopy(spec)
            # The nanny sets this config in the worker (its top-level keys replace this
            # process's, so the whole daskllm section).
            daskllm_config = dask.config.merge(dask.config.get("daskllm"),
                                               {"engine": {"cpu-cores": ",".join(map(str, mine))}})
            spec.setdefault("options", {})["config"] = {**spec["options"].get("config", {}), "daskllm": daskllm_config}
            out[name] = spec
        return out

    # --- keeping every worker slot filled -------------------------------------------------

    def _update_worker_status(self, op, msg):
        """A worker left: its nanny restarts it. SpecCluster's own check closes a worker slot
        whose name is absent ``lost-worker-timeout`` after any removal, even while the nanny
        is restarting a later incarnation (a worker killed again soon after it came back); and
        a nanny that gave up is never replaced. Here a slot is replaced only if its nanny no
        longer runs a worker process, and then a fresh one takes its place; the slot of a worker
        retired on purpose (``client.retire_workers``) goes, as with ``scale_down``."""
        if op != "remove" or not self.processes:
            return super()._update_worker_status(op, msg)
        name = self.scheduler_info["workers"].get(msg, {}).get("name")
        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        asyncio.get_running_loop().call_later(delay, self._replace_if_given_up, name, msg)
        Cluster._update_worker_status(self, op, msg)

    def _replace_if_given_up(self, name, address: str) -> None:
        nanny = self.workers.get(name)
        if self.status != Status.running or nanny is None or name not in self.worker_spec:
            return  # closing, or scaled down on purpose
        # Drained by the scheduler (its nanny closes too): not a loss to make good. The
        # scheduler runs in this process, and records the retirement as an event.
        if any(event.get("action") == "retired" for _, event in self.scheduler.get_events(address)):
            del self.worker_spec[name]
            self._futures.add(asyncio.ensure_future(self._correct_state()))
            return
        process = getattr(nanny, "process", None)
        if nanny.status == Status.running and process is not None and process.status in (Status.starting, Status.running):
            return  # restarting, or back
        logger.warning("daskllm: the nanny of worker %r gave up (%s); starting a fresh one", name, nanny.status)
        del self.workers[name]
        self._futures.add(asyncio.ensure_future(self._close_and_refill(nanny)))

    async def _close_and_refill(self, nanny) -> None:
        try:
            await nanny.close()
        finally:
            await self._correct_state()

    @property
    def models(self) -> list[str]:
        """Names of the LLMs every worker holds."""
        return [s.engine_name for s in self.engine_specs if s.kind == "llm"]
