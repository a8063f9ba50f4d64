"""The commit path: a new version's weights, checkpoint, ledger line, acknowledgements, version event.

Order and what a crash at each point leaves (the trainer restarts from the last checkpoint):

    weights file  -> before_checkpoint: the file is rewritten by the retrained step; nothing else happened
    checkpoint    -> after_checkpoint: restore appends the ledger line the checkpoint holds; the groups'
                     entries come back as pending and are acknowledged (they are in ``consumed``)
    ledger line   -> after_ledger: as above, without the append
    acknowledge   -> after_ack: restore publishes the version (the stream is behind the checkpoint)
    publish       -> after_publish: nothing to repair

Fault injection (tests only): the environment variable ``FAULT_INJECT_STREAMRL_TRAINER_CRASH`` (not
``STREAMRL_*``: that prefix is configuration) = ``POINT`` or ``POINT@N`` makes the trainer SIGKILL itself
at POINT of its N-th commit in this process (default 1). Unset in every real run.
"""

from __future__ import annotations

import os
import signal

from shared.protocol import ledger

FAULT_ENV = "FAULT_INJECT_STREAMRL_TRAINER_CRASH"
POINTS = ("before_checkpoint", "after_checkpoint", "after_ledger", "after_ack", "after_publish")


def fault_injection_point(point: str, commit_number: int) -> None:
    """Test hook: SIGKILL this process when ``FAULT_ENV`` names this point (and commit). No-op when unset."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name not in POINTS:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected one of {', '.join(POINTS)}, optionally @N")
    if name == point and commit_number == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def record(version: int, step: int, trained: list[str], skipped: list[str]) -> dict:
    return {"commit": version, "version": version, "step": step, "groups": trained, "skipped": skipped}


def restore_ledger(directory, state: dict | None, log) -> None:
    """Cut a torn last line; append the checkpoint's own commit line when the ledger is behind it."""
    torn = ledger.repair_ledger(directory)
    if torn:
        log.warning("torn last ledger line removed", bytes=torn)
    if state is None or "ledger_record" not in state:
        return
    if ledger.last_commit(ledger.read_ledger(directory)) < state["version"]:
        ledger.append_ledger(directory, state["ledger_record"])
        log.warning("ledger behind the checkpoint; commit line appended", version=state["version"])
