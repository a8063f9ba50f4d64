"""The commit path: a new version's weights, checkpoint, ledger line, acknowledgements, version event.

Order and what a crash at each point leaves (the trainer restarts from the last checkpoint):

    weights file  -> before_checkpoint: the file is rewritten by the retrained step; nothing else happened
    checkpoint    -> after_checkpoint: restore appends the ledger line the checkpoint holds; the groups'
                     entries come back as pending and are acknowledged (they are in ``consumed``)
    ledger line   -> after_ledger: as above, without the append
    acknowledge   -> after_ack: restore publishes the version (the stream is behind the checkpoint)
    publish       -> after_publish: nothing to repair

Each point is a crash point of ``shared/runtime/faults.py`` (tests only: ``FAULT_INJECT_STREAMRL_CRASH=
trainer:POINT[@N]`` makes the trainer SIGKILL itself there in its N-th commit).
"""

from __future__ import annotations

from shared.protocol.archive import ledger


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
