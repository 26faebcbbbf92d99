"""Running the app: uvicorn on 127.0.0.1 by default, in the foreground or in a thread."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import uvicorn

from daskllm import config
from daskllm.serve.app import create_app
from daskllm.serve.service import Service


class Interrupted(BaseException):
    """The first SIGINT or SIGTERM: stop, and close what was started. A BaseException, as
    KeyboardInterrupt is, so that no library's ``except Exception`` swallows it."""


def stop_on_signals() -> None:
    """From now on the first SIGINT or SIGTERM raises :class:`Interrupted` in the main thread,
    wherever it is (start-up included); a second exits at once. A terminal's Ctrl-C (or a
    supervisor's stop) reaches the whole process group; the local workers ignore it and go
    when their parent does."""

    def first(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _exit_now)
        raise Interrupted(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, first)


def _exit_now(*_) -> None:
    """A second signal while closing: the user means it."""
    sys.stderr.flush()
    os._exit(0)


class _Server(uvicorn.Server):
    """uvicorn's server, saying once it answers (and on which port, when it was given 0)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]):
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and threading.current_thread() is threading.main_thread():
            _exit_now()  # a second signal while uvicorn shuts down
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket (port 0: a free one), so the address is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def run(service: Service, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        on_started: Callable[[str], None] = print, log_level: str = "warning", access_log: bool = True) -> None:
    """Serve until interrupted (SIGINT/SIGTERM). uvicorn handles the signal while it serves,
    shuts down, then raises it again for the handler it found: with :func:`stop_on_signals`,
    :class:`Interrupted` comes out of here, and the caller closes its cluster."""
    sock = bind(host, port)
    url = base_url(sock)
    # uvicorn's own access log is off: the app's has the model, tokens and request id.
    server = _Server(uvicorn.Config(create_app(service, api_key=api_key, access_log=access_log),
                                    log_level=log_level, access_log=False), lambda: on_started(url))
    server.run(sockets=[sock])


@contextlib.contextmanager
def serving(client, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
            timeout: float = 60.0, access_log: bool | None = None, **service_options) -> Iterator[str]:
    """Serve ``client``'s cluster from a background thread; yields the base URL (``.../v1``).

    ``access_log``: log each request to ``daskllm.serve.access`` (default: the config key
    ``daskllm.serve.access-log``; where the lines go is the program's logging setup).
    ``service_options`` go to :class:`Service` (``consolidate``, ``window``, ``max_batch``,
    ``pipelines``, ``pipelines_index``, ``plan_options``)."""
    if access_log is None:
        access_log = bool(config.get("serve.access-log", True))
    service = Service(client, **service_options)
    sock = bind(host, port)
    started = threading.Event()
    server = _Server(uvicorn.Config(create_app(service, api_key=api_key, access_log=access_log), log_level="warning",
                                    access_log=False), started.set)
    failed: list[BaseException] = []

    def run_server():
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # noqa: BLE001 - reported by the thread that waits for the start
            failed.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run_server, name="daskllm-serve", daemon=True)
    thread.start()
    try:
        if not started.wait(timeout):
            raise TimeoutError(f"the server did not start within {timeout} s")
        if failed or not server.started:
            raise RuntimeError(f"the server did not start: {failed[0] if failed else 'it stopped'}")
        yield base_url(sock)
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
