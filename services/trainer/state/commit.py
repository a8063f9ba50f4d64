"""The commit path: what a new version does, in order, and what a crash at each point leaves.

    ledger line    its commit line, fsynced: the version exists. It names the groups each step of the version trained,
                   in order (``batches``), the step count and the trainer's counters: everything a restart needs to
                   train it again from the episode log (services/trainer/state/replay.py)
    acknowledge    the groups' samples entries leave the pending list (the log, not the pending list, is what a replay
                   reads)
    hand over      the version's weights, copied in memory, go to the publisher's thread (services/trainer/
                   publisher.py): delta or full file, sha256, version event; off the critical path
    snapshot       every ``snapshot_every_versions`` (or ``snapshot_every_s``, or once the steps since the last took
                   ``snapshot_replay_s`` to train): model, optimizer and RNG copied in memory, written in the
                   background (services/trainer/state/snapshot.py)

Crash points (``shared/runtime/faults.py``) and what the restart does (it loads the newest snapshot, then re-trains
every commit line after it):

    before_ledger    nothing durable: the groups come back as pending entries and train again, once
    after_ledger     the version is re-trained from the log; its entries come back pending and are acknowledged as
                     already trained
    after_ack        the version is re-trained and published (the versions stream is behind the ledger)
    after_publish    (the publisher's thread) re-trained, hashed, found equal to the published sha256: nothing
                     published again
    snapshot_write   (the snapshot's thread, mid-write) the temporary file is ignored; the snapshot before is used
"""

from __future__ import annotations

from shared.protocol.archive import ledger


def batch_of(groups: list[tuple[str, list[str]]]) -> list:
    """One training step's groups as the ledger keeps them, in the order they trained: ``[group, n]`` when the
    episodes are the group's own ``<group>-0 .. <group>-<n-1>`` (always, for the rollout's groups), else ``[group,
    [episode ids]]``."""
    out = []
    for group_id, eids in groups:
        own = list(eids) == [f"{group_id}-{i}" for i in range(len(eids))]
        out.append([group_id, len(eids) if own else list(eids)])
    return out


def record(version: int, step: int, trained: list[str], skipped: list[str], batches: list[list], counts: dict) -> dict:
    return {
        "commit": version,
        "version": version,
        "step": step,
        "groups": trained,
        "skipped": skipped,
        "batches": batches,
        "counts": dict(counts),
    }


def repair(directory, log) -> None:
    """Cut a torn last line (a crash mid-append) before anything reads or appends."""
    torn = ledger.repair_ledger(directory)
    if torn:
        log.warning("torn last ledger line removed", bytes=torn)
