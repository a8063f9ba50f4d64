"""A small run made of real parts: episodes written by the real EpisodeLog, samples entries, ledger lines."""

from __future__ import annotations

from pathlib import Path

from shared.protocol.archive.ledger import append_ledger
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams import samples


def write_episode(
    log: EpisodeLog, episode_id: str, group_id: str, version: int, n_tokens: int = 40, end: bool = True
) -> None:
    log.open(episode_id)
    index = int(episode_id.rsplit("-", 1)[1]) if episode_id.rsplit("-", 1)[-1].isdigit() else 0
    log.append(
        episode_id,
        "started",
        {
            "episode_id": episode_id,
            "group_id": group_id,
            "index": index,
            "prompt_ids": [5, 6, 7],
            "sampling": {"max_tokens": 64},
            "task": {"answer": "42"},
        },
        version,
    )
    for start in range(0, n_tokens, 16):
        ids = [(start + i) * 7 % 500 for i in range(min(16, n_tokens - start))]
        log.append_tokens(episode_id, ids, [-0.25 - 0.01 * i for i in range(len(ids))], version)
        log.flush_or_raise([episode_id])
    if end:
        log.append(episode_id, "finished", {"reason": "stop", "reward": float(version % 2), "details": {}}, version)
    log.flush_or_raise([episode_id])
    log.close(episode_id)


def make_run(client, keys, run_path: Path, versions: int, per_group: int = 2) -> dict[str, list[str]]:
    """One group per version 1..versions, trained and committed at that version; returns group -> episodes."""
    log = EpisodeLog(client, keys, "w1")
    groups = {}
    for v in range(1, versions + 1):
        group_id = f"g{v}"
        eids = [f"{group_id}-{i}" for i in range(per_group)]
        for eid in eids:
            write_episode(log, eid, group_id, v)
        client.xadd(keys.samples, samples.encode(samples.Sample(group_id, eids, "w1")))
        append_ledger(
            Path(run_path) / "trainer", {"commit": v, "version": v, "step": v, "groups": [group_id], "skipped": []}
        )
        groups[group_id] = eids
    return groups


def all_streams(client, keys, episode_ids) -> dict[str, list]:
    return {eid: client.xrange(keys.episode(eid)) for eid in episode_ids}


def one_segment(client, keys, run_path: Path, versions: int) -> tuple[list[str], dict[str, list], Path]:
    """A run's episodes written to one segment file (listed in the manifest): (episode ids, their streams as
    Redis gave them, the segments' folder)."""
    from shared.protocol.archive import builder as segment_builder
    from shared.protocol.archive import segments

    groups = make_run(client, keys, run_path, versions=versions)
    eids = [e for es in groups.values() for e in es]
    hot = all_streams(client, keys, eids)
    folder = run_path / "episodes"
    segments.write_file(folder, "seg-00000001.parquet", segment_builder.table_of((e, hot[e]) for e in eids))
    segments.append_manifest(folder, {"segment": "seg-00000001.parquet", "episodes": len(eids)})
    return eids, hot, folder


def row_of(episode_id: str, entries: list, seed_base: int | None = None) -> dict:
    """An episode's segment row, read back from its one-row table: every column as ``to_pylist`` gives it, but
    ``tok_ids`` / ``tok_logprobs`` as their raw little-endian bytes (a null log-prob +0.0), as ``unpack`` takes them."""
    from shared.protocol.archive import builder as segment_builder
    from shared.protocol.archive import segments

    table = segment_builder.table_of([(episode_id, entries)], seed_base)
    (_, ids), (_, lps) = segments.token_bytes(table, "tok_ids"), segments.token_bytes(table, "tok_logprobs")
    return {**table.drop_columns(segments.TOKENS).to_pylist()[0], "tok_ids": ids, "tok_logprobs": lps}
