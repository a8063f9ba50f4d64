"""One real Redis-protocol server per test session (per xdist worker), on a free loopback port."""

from __future__ import annotations

import os

# One torch thread in this process and in every process a test starts (they inherit the environment), as
# `streamrl run` gives its services: the suite runs two test workers and several service processes on two cores,
# and more threads only spin against each other (a scripted model's fit took 125 s instead of 3 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import threading
import uuid

import pytest

from services.ops.launch.redis_server import EmbeddedRedis
from shared.protocol.keys import Keys
from shared.runtime.connection import connect

# a slow test's wall time when its marker gives none (`@pytest.mark.slow(seconds=N)`)
SLOW_SECONDS = 10


def pytest_collection_modifyitems(config, items):
    """The longest files first, so the test workers (one file each at a time, in this order: `./dev test` passes
    --no-loadscope-reorder) do not end on one long file while the others stand idle. A file weighs its measured
    seconds (tests/durations.json, tests/support/durations.py), or else the seconds its slow tests are marked with.
    Within a file the order stays."""
    from tests.support.durations import load

    measured = load()
    weight: dict[str, float] = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        weight[item.nodeid.split("::")[0]] = weight.get(item.nodeid.split("::")[0], 0.0) + (
            mark.kwargs.get("seconds", SLOW_SECONDS) if mark else 0.0
        )
    weight.update({path: s for path, s in measured.items() if path in weight})
    # stable: ties keep the collection order
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])


def pytest_terminal_summary(terminalreporter):
    """Figures a test measured (``record_property("figure", "name: value")``), listed at the end of the run, so a
    log shows them (CI's vLLM step reports the vLLM engine's mismatch KL this way)."""
    lines = [
        value
        for report in terminalreporter.stats.get("passed", [])
        if report.when == "call"
        for key, value in report.user_properties
        if key == "figure"
    ]
    if lines:
        terminalreporter.section("figures")
        for line in sorted(lines):
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def run_dir_outside_the_checkout(tmp_path_factory):
    """Service processes a test starts without a run folder of its own write under this session's temp folder,
    never under the checkout's runs/; the gateway stacks' run folders go under it too, not loose in the temp dir."""
    from tests.support.gateway_stack import SCRATCH_ENV

    os.environ.setdefault("STREAMRL_RUN_DIR", str(tmp_path_factory.mktemp("runs")))
    os.environ[SCRATCH_ENV] = str(tmp_path_factory.mktemp("stacks"))


@pytest.fixture(scope="session", autouse=True)
def one_starter_per_worker():
    """The processes of every `streamrl run` a test starts fork from this worker's one warm starter
    (tests/support/procs.py) instead of one each run preloads."""
    from tests.support.procs import share_starter

    share_starter()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def client(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()


@pytest.fixture
def keys() -> Keys:
    """A fresh run namespace per test, so tests never see each other's keys."""
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def cli_env(redis_url, keys, tmp_path) -> dict:
    """Environment for `streamrl` subprocesses pointed at the test server and run (its folder under tmp_path)."""
    return {
        **os.environ,
        "REDIS_URL": redis_url,
        "STREAMRL_RUN": keys.run,
        "STREAMRL_LOG_LEVEL": "warning",
        "STREAMRL_RUN_DIR": str(tmp_path / "runs"),
    }


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from services.ops.launch.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def tiny_model_dir_hd32(tmp_path_factory) -> str:
    """The tiny Llama with head size 32 (hidden 128, 4 heads): the smallest vLLM's CPU
    attention accepts (16 is refused), so both engines can run the same model."""
    from services.ops.launch.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-hd32")), hidden_size=128)


CLUSTER_PASSWORD = "cluster-secret"


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real 3-master Redis Cluster (password-protected) on loopback for the session:
    tests/support/redis_cluster.py."""
    from tests.support.redis_cluster import LocalCluster

    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), password=CLUSTER_PASSWORD).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_client(redis_cluster):
    c = connect(redis_cluster.url)
    yield c
    c.close()


@pytest.fixture
def start_syncer(request, client, keys, tiny_model_dir):
    """Real Syncer.run loops in threads, reading the versions stream like the process does (config overrides as
    keywords; heartbeat_ttl: the test module's HEARTBEAT_TTL)."""
    running = []

    from services.syncer.syncer import Syncer
    from shared.runtime import logs
    from shared.runtime.config.keys import Config

    def start(**overrides) -> Syncer:
        cfg = Config(
            **{
                "run": keys.run,
                "model_dir": tiny_model_dir,
                "sync_timeout": 20.0,
                "heartbeat_ttl": getattr(request.module, "HEARTBEAT_TTL", 5.0),
                **overrides,
            }
        )
        stop = threading.Event()
        syncer = Syncer(cfg, client, logs.get("syncer-test"))
        thread = threading.Thread(target=syncer.run, kwargs={"should_stop": stop.is_set}, daemon=True)
        thread.start()
        running.append((stop, thread))
        return syncer

    yield start
    for stop, thread in running:
        stop.set()
        thread.join(30)
