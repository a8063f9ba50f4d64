"""Fail fast and the failures on the progress line: read from real `agent` metrics records in a real Redis."""

from __future__ import annotations

from services.driver.failfast import FailFast
from services.driver.status import agent_failures, failures_words, format_line, snapshot
from shared.protocol.streams import metrics

ERROR = "agent m:f raised NotFoundError: Error code: 404 - POST /ep/<episode>/v1/nonexistent: no such API"


def ended(client, keys, group: str, i: int, error: str | None = ERROR) -> None:
    """What the agents runner writes per ended episode (services/gateway/runner.py)."""
    record = {"episode": f"{group}-{i}", "group": group, "status": "failed" if error else "finished"}
    metrics.record(client, keys, "agent", {**record, **({"error": error} if error else {})})
    client.hincrby(keys.agents_ended, record["status"], 1)


def test_the_first_groups_all_failing_for_one_reason_stop_the_run_once(client, keys):
    # a continued run's earlier failures are not counted
    ended(client, keys, "old", 0)
    ff = FailFast(client, keys, groups=2, group_size=2)
    ended(client, keys, "g0", 0)
    ended(client, keys, "g0", 1)
    ended(client, keys, "g1", 0)
    assert ff.poll(0) is None
    # an episode recorded twice (a re-run job) is one episode
    ended(client, keys, "g1", 0)
    assert ff.poll(0) is None
    ended(client, keys, "g1", 1)
    why = ff.poll(0)
    assert why.startswith("driver: the first 2 groups' episodes all failed and nothing trained") and ERROR in why
    assert "\n" not in why
    # said once
    ended(client, keys, "g2", 0)
    assert ff.poll(0) is None


def test_anything_that_can_train_turns_it_off(client, keys):
    cases = {
        "finished": lambda k: ended(client, k, "g0", 1, error=None),
        "another error": lambda k: ended(client, k, "g0", 1, error=ERROR + " (other)"),
    }
    for what, second in cases.items():
        k = keys.__class__(f"{keys.run}-{what.replace(' ', '')}")
        ff = FailFast(client, k, groups=1, group_size=2)
        ended(client, k, "g0", 0)
        second(k)
        assert ff.poll(0) is None and ff.off, what
    # a version published: something trained
    ff = FailFast(client, keys, groups=1, group_size=1)
    ended(client, keys, "g0", 0)
    assert ff.poll(1) is None and ff.poll(0) is None
    # 0: never
    ff = FailFast(client, keys, groups=0, group_size=1)
    ended(client, keys, "g9", 0)
    assert ff.poll(0) is None


def test_the_progress_line_counts_failed_episodes_and_shows_the_most_common_error(client, keys):
    assert agent_failures(client, keys) is None
    for i in range(3):
        ended(client, keys, "g0", i)
    ended(client, keys, "g1", 0, error="agent m:f raised ValueError: once")
    ended(client, keys, "g1", 1, error=None)
    a = agent_failures(client, keys)
    assert (a["failed"], a["finished"], a["recent"], a["recent_failed"], a["top_count"]) == (4, 1, 5, 4, 3)
    # what the error says, not the runner's "agent m:f raised" every line has
    assert a["top_error"] == "NotFoundError: Error code: 404 - POST /ep/<episode>/v1/nonexistent: no such API"
    line = format_line(snapshot(client, keys))
    assert f"failed 4/5 episodes (recent 4 of 5, most: 3x {a['top_error']})" in line
    assert failures_words({**a, "failed": 0}) == ""
