"""The LLM page, /llm/metrics.json and Prometheus lines, fetched over HTTP while a job runs;
what the dashboard exposes (loopback by default), and what a storm of requests costs."""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import dask.config
import psutil
import pytest
from distributed.comm import get_tcp_server_addresses
from distributed.utils_test import poll_for

import daskllm
from daskllm import LocalLLMCluster, cli, demo
from daskllm.dashboard.cache import SnapshotCache, cache_of
from daskllm.dashboard.page import budget_of, llm_doc
from daskllm.worker import gpu_metrics


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(n_workers=2, threads_per_worker=4, dashboard_address="127.0.0.1:0") as client:
        # A worker reports its engines from the first heartbeat after they have loaded.
        # Workers join before their engines load: wait for both.
        workers = set(client.scheduler_info()["workers"])
        poll_for(lambda: set((m := metrics(client.cluster))["workers"]) == workers
                 and all("tiny" in w["engines"] for w in m["workers"].values()), timeout=60)
        yield client


@pytest.fixture(scope="module")
def cluster(client):
    return client.cluster


def base(cluster) -> str:
    return cluster.dashboard_link.rsplit("/", 1)[0]


def fetch(url: str, method: str = "GET") -> tuple[int, str]:
    return request(url, method)[::2]


def request(url: str, method: str = "GET") -> tuple[int, dict, str]:
    """Status, headers and body of one HTTP request (a body sent only where the method has one)."""
    data = None if method in ("GET", "HEAD") else b"{}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, data=data), timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def metrics(cluster) -> dict:
    status, body = fetch(base(cluster) + "/llm/metrics.json")
    assert status == 200
    return json.loads(body)


def long_job(client):
    questions = [f"Question {i}: how do I read file number {i}?" for i in range(48)]
    node = daskllm.generate(daskllm.prompt("You answer questions about files.\n{q}\nA:", q=questions),
                            max_tokens=48, ignore_eos=True)
    return client.compute(node)


def decoded(snapshot: dict) -> int:
    return sum(e.get("decode_tokens", 0) for w in snapshot["workers"].values() for e in w["engines"].values()
               if e["kind"] == "llm")


def test_metrics_json_moves_while_a_job_runs(client, cluster):
    before = metrics(cluster)
    assert set(before["workers"]) == set(client.scheduler_info()["workers"])
    for w in before["workers"].values():
        assert w["models"]["llm"] == ["tiny"] and "tiny" in w["engines"]
        assert {"running", "waiting", "cache_blocks_used", "cache_blocks_total", "prefix_cache_hit_rate",
                "mean_batch_size", "decode_tokens_per_s"} <= set(w["engines"]["tiny"])
        assert "gpu" not in w  # CPU workers: no GPU section, and no error
    future = long_job(client)
    poll_for(lambda: decoded(metrics(cluster)) > decoded(before), timeout=30)  # counters move ...

    def decode_rate():
        return max(e["decode_tokens_per_s"] for w in metrics(cluster)["workers"].values()
                   for e in w["engines"].values() if e["kind"] == "llm")

    poll_for(lambda: decode_rate() > 0, timeout=30, period=0.2)  # ... and so do the rates
    future.result()
    poll_for(lambda: decoded(metrics(cluster)) >= decoded(before) + 48 * 48, timeout=30)
    assert sum(metrics(cluster)["placement"]["decisions"].values()) > 0


def test_prometheus_lines_on_the_scheduler(client, cluster):
    before = decoded(metrics(cluster))
    long_job(client).result()
    poll_for(lambda: decoded(metrics(cluster)) >= before + 48 * 48, timeout=30)  # the next heartbeats
    status, body = fetch(base(cluster) + "/metrics")
    assert status == 200
    lines = [line for line in body.splitlines() if line.startswith("daskllm_")]
    names = {line.split("{")[0].split(" ")[0] for line in lines}
    assert {"daskllm_prefix_cache_hits_total", "daskllm_decode_tokens_total", "daskllm_requests_running",
            "daskllm_cache_blocks_total", "daskllm_placement_decisions_total"} <= names
    decode = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("daskllm_decode_tokens_total{")]
    assert len(decode) == 2 and sum(decode) >= 48 * 48


def test_the_page_is_in_the_dashboard_and_routes_are_read_only(client, cluster):
    status, page = fetch(base(cluster) + "/llm")
    assert status == 200 and "bokeh" in page.lower() and '<a href="llm">' in page
    status, menu = fetch(base(cluster) + "/status")
    assert status == 200 and '<a href="llm">' in menu  # in the dashboard's menu, on every page
    for method in ("POST", "PUT", "DELETE"):
        assert fetch(base(cluster) + "/llm/metrics.json", method)[0] == 405


def test_head_is_answered_and_routes_match_their_exact_path(client, cluster):
    budget = budget_of(cluster.scheduler)
    pages = (budget.built, budget.refused)
    status, headers, body = request(base(cluster) + "/llm/metrics.json", "HEAD")
    assert status == 200 and headers["Content-Type"] == "application/json" and body == ""
    assert int(headers["Content-Length"]) > 0  # the length of the GET's body
    status, headers, body = request(base(cluster) + "/llm", "HEAD")
    assert status == 200 and headers["Content-Type"] == "text/html" and body == ""
    assert (budget.built, budget.refused) == pages  # HEAD builds no page
    assert fetch(base(cluster) + "/llm/metrics.json")[0] == 200
    for path in ("/llm/metricsXjson", "/llm/metrics.jsonX", "/llm/metrics.json/x", "/xllm/metrics.json"):
        assert fetch(base(cluster) + path)[0] == 404, path
        assert request(base(cluster) + path, "HEAD")[0] == 404, path


def test_a_request_storm_builds_one_snapshot(client, cluster):
    """Many concurrent readers (JSON, HEAD, Prometheus) share one snapshot per refresh interval."""
    cache = cache_of(cluster.scheduler)
    urls = [(base(cluster) + "/llm/metrics.json", "GET")] * 40 + [(base(cluster) + "/llm/metrics.json", "HEAD")] * 10 \
        + [(base(cluster) + "/metrics", "GET")] * 10
    with dask.config.set({"daskllm.dashboard.refresh": 3600}):  # an hour: no interval ends during the storm
        builds = cache.builds
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda u: request(*u), urls))
        assert cache.builds - builds <= 1  # one build if the last snapshot was older than the interval, else none
    assert all(status == 200 for status, _, _ in answers)
    bodies = {body for (_, method), (_, _, body) in zip(urls, answers) if method == "GET" and body.startswith("{")}
    assert len(bodies) == 1  # every JSON reader got the same snapshot (its "time" included)
    prometheus = [body for (url, _), (_, _, body) in zip(urls, answers) if url.endswith("/metrics")]
    assert all("daskllm_decode_tokens_total{" in body for body in prometheus)


def test_the_snapshot_is_rebuilt_once_per_interval():
    now = [100.0]
    cache = SnapshotCache(build=lambda scheduler: {"built_at": now[0]}, clock=lambda: now[0])
    with dask.config.set({"daskllm.dashboard.refresh": "2s"}):
        first = cache.get("scheduler")
        assert all(cache.get("scheduler") is first for _ in range(100)) and cache.builds == 1
        now[0] += 1.9
        assert cache.get("scheduler") is first and cache.builds == 1
        now[0] += 0.1
        assert cache.get("scheduler") == {"built_at": 102.0} and cache.builds == 2


def test_gpu_metrics_are_absent_on_a_cpu_machine():
    assert gpu_metrics() is None


def test_the_page_updates_live(client, cluster):
    """The page's document, updated from the scheduler while a job runs (as the browser sees it)."""
    from daskllm.dashboard.page import LLMPage

    scheduler = cluster.scheduler
    page = LLMPage(scheduler)
    page.update()
    future = long_job(client)
    poll_for(lambda: (page.update() or True) and sum(page.series.data["decode"]) > 0, timeout=30)
    future.result()
    page.update()
    assert page.workers.data["worker"] and len(page.models.data["models"]) == 2
    assert "tiny" in page.models.data["models"][0]
    assert sum(page.decisions.data["tasks"]) > 0


# --- in a real browser ---------------------------------------------------------------------------


def _chromium() -> str | None:
    import shutil

    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.browser
def test_the_page_renders_with_data_in_headless_chromium(client, cluster, tmp_path):
    """Debian's chromium, headless: the page loads, its Bokeh data sources fill while a job runs,
    and a screenshot is taken (set DASKLLM_SCREENSHOT=path to keep it)."""
    import base64
    import os
    import re
    import subprocess

    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); .ci/run installs it")
    browser = subprocess.Popen([binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                f"--user-data-dir={tmp_path / 'profile'}", "--remote-debugging-port=0",
                                "--window-size=1400,1000", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in browser.stderr:
            match = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "chromium did not start its DevTools endpoint"
        future = long_job(client)
        status, body = fetch(f"http://127.0.0.1:{port}/json/new?{base(cluster)}/llm", method="PUT")
        assert status == 200
        target = json.loads(body)["webSocketDebuggerUrl"]
        sizes, png = asyncio.run(_inspect(target))
        future.result()
    finally:
        browser.kill()
        browser.wait()
    assert sizes, "no Bokeh document in the page"
    assert max(sizes) > 0, f"the page's data sources are empty: {sizes}"
    image = base64.b64decode(png)
    assert image[:8] == b"\x89PNG\r\n\x1a\n" and len(image) > 10_000
    if os.environ.get("DASKLLM_SCREENSHOT"):
        with open(os.environ["DASKLLM_SCREENSHOT"], "wb") as f:
            f.write(image)


_SOURCES_JS = """
(() => {
  if (!window.Bokeh || !Bokeh.documents.length) return null;
  const sizes = [];
  for (const m of Bokeh.documents[0].all_models) {
    if (m.data !== undefined && m.data !== null) {
      const cols = (m.data instanceof Map) ? [...m.data.values()] : Object.values(m.data);
      sizes.push(cols.length ? cols[0].length : 0);
    }
  }
  return JSON.stringify(sizes);
})()
"""


async def _inspect(target: str):
    """Over the DevTools protocol: wait for data in the page's sources, then a screenshot."""
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(target, max_message_size=64 * 2**20)
    counter = iter(range(1, 10_000))

    async def call(method, **params):
        request_id = next(counter)
        await ws.write_message(json.dumps({"id": request_id, "method": method, "params": params}))
        while True:
            message = json.loads(await ws.read_message())
            if message.get("id") == request_id:
                return message.get("result", {})

    sizes = []
    for _ in range(60):  # up to ~30 s: page load, websocket, first periodic updates
        await asyncio.sleep(0.5)
        result = await call("Runtime.evaluate", expression=_SOURCES_JS, returnByValue=True)
        value = result.get("result", {}).get("value")
        if value:
            sizes = json.loads(value)
            if sizes and max(sizes) > 0 and sum(s > 0 for s in sizes) >= 3:
                break
    shot = await call("Page.captureScreenshot", format="png")
    ws.close()
    return sizes, shot.get("data", "")


def charted_pages(dask_scheduler) -> int:
    """Open sessions of the LLM page drawing charts, as Bokeh counts them (on the scheduler's loop)."""
    from bokeh.models import Div

    app = next(a for a in dask_scheduler.http_application.applications if "/llm" in getattr(a, "app_paths", ()))
    return sum(not isinstance(session.document.roots[0], Div) for session in app.get_sessions("/llm"))


def test_a_page_storm_builds_at_most_max_pages(client, cluster):
    """Each page with charts is built and updated on the scheduler's event loop: a storm of GETs
    builds at most daskllm.dashboard.max-pages of them; the others are refused, saying why."""
    budget = budget_of(cluster.scheduler)
    built, refused, n = budget.built, budget.refused, 20
    most = budget.open + 2  # pages left open by earlier tests, and 2 more
    with dask.config.set({"daskllm.dashboard.max-pages": most}):
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: request(base(cluster) + "/llm"), range(n)))
    assert client.run_on_scheduler(charted_pages) <= most and budget.open <= most
    # The 2 free places are taken (more only if an earlier page closed meanwhile), the rest refused.
    assert budget.built - built >= 2 and budget.refused - refused <= n - 2
    told = [status for status, _, body in answers if "too many pages open" in body]
    assert len(told) == budget.refused - refused and len(told) + budget.built - built == n
    assert set(told) <= {503, 200}  # 200: a page saying so, if a request raced past the handler's check
    assert all(status == 200 for status, _, body in answers if "too many pages open" not in body)


def test_a_page_past_the_limit_draws_no_charts(cluster):
    """The limit holds in the page itself too (requests racing past the handler's check)."""
    from bokeh.document import Document
    from bokeh.models import Div

    budget = budget_of(cluster.scheduler)
    built, doc = budget.built, Document()
    with dask.config.set({"daskllm.dashboard.max-pages": 0}):
        llm_doc(cluster.scheduler, {}, doc)
    assert budget.built == built and len(doc.roots) == 1 and isinstance(doc.roots[0], Div)
    assert "daskllm.dashboard.max-pages" in doc.roots[0].text and not doc.callbacks.session_callbacks


# --- what the dashboard exposes --------------------------------------------------------------


@pytest.fixture(scope="module")
def default_cluster(tiny_model_dir):
    """A LocalLLMCluster as a user starts it: no dashboard address, no host (no workers: only
    the scheduler and its dashboard are under test)."""
    with LocalLLMCluster(models=["tiny"], n_workers=0) as cluster:  # 127.0.0.1:8787, or another port if taken
        yield cluster


def dashboard_port(cluster) -> int:
    return cluster.scheduler.http_server.port


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_the_default_cluster_listens_on_loopback_only(default_cluster):
    assert default_cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    hosts = {address[0] for address in get_tcp_server_addresses(default_cluster.scheduler.http_server)}
    assert hosts == {"127.0.0.1"}
    assert default_cluster.dashboard_link.startswith("http://127.0.0.1:")
    assert fetch(f"http://127.0.0.1:{dashboard_port(default_cluster)}/llm/metrics.json")[0] == 200


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_the_default_dashboard_refuses_other_interfaces(default_cluster):
    others = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
              if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    if not others:
        pytest.skip("this machine has no IPv4 address but loopback to try the dashboard from")
    for address in others:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, dashboard_port(default_cluster)), timeout=10).close()


def test_the_demo_cli_defaults_to_loopback():
    option = next(p for p in cli.demo.params if p.name == "dashboard_address")
    assert option.default == "127.0.0.1:8787"
    assert inspect.signature(demo.run).parameters["dashboard_address"].default == "127.0.0.1:8787"
