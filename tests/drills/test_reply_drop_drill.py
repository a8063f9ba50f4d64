"""The reply-drop drill: a short live run whose every process talks to Redis through
tests/support/fault_proxy.py, which drops replies after the server executed the command and cuts pipelines, at random
(seeded). Every command is retried; every write a retry can repeat is idempotent, so `streamrl check` counts
0 groups enqueued twice, 0 finished twice, 0 trained twice, and the versions have no duplicate or gap."""

from __future__ import annotations

import pytest

from services.ops.check.checker import check, format_report, read_run
from tests.drills.test_faults import _config
from tests.support.fault_proxy import FaultProxy
from tests.support.fault_run import LiveRun

MAX_VERSIONS = 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replies_dropped_at_random_do_no_work_twice(tmp_path, tiny_model_dir):
    proxies = []

    def through_proxy(port: int) -> str:
        proxies.append(FaultProxy("127.0.0.1", port, drop_reply=0.003, cut_request=0.02, seed=7, max_faults=40).start())
        return proxies[0].url

    run = LiveRun(
        tmp_path,
        **_config(
            tmp_path,
            tiny_model_dir,
            "replydrop",
            max_versions=MAX_VERSIONS,
            tools="calc",
            step_delay_ms=0.0,
            redis_wait=60.0,
        ),
    )
    try:
        run.start(rollout_workers=2, proxy=through_proxy)
        run.wait_version(MAX_VERSIONS, timeout=420)
        run.wait(lambda: run.procs["driver-1"].poll() is not None, "the driver to end the run", timeout=60)
    finally:
        run.stop()
        for p in proxies:
            p.stop()
    report = check(read_run(run.client, run.keys, run.cfg.run_path))
    text = format_report(report, run.cfg.run)
    faults = dict(proxies[0].faults)
    run.server.stop()
    assert sum(faults.values()) > 0, f"the proxy injected no fault: the drill tested nothing\n{text}"
    counts = {
        "groups enqueued twice": report.groups_enqueued_twice,
        "finished twice": report.episodes_finished_twice,
        "trained twice": report.samples_trained_twice,
        "versions repeated": report.versions_repeated,
        "versions missing": report.versions_missing,
        "groups lost": report.groups_lost,
    }
    assert all(v == 0 for v in counts.values()), f"{counts}; faults {faults}\n{text}\n{run.tail()}"
    # the run did train through the faults
    assert report.groups_trained >= MAX_VERSIONS * 2, text
    print(f"faults injected: {faults}\n{text}")
