"""The streams whose heads the driver moves out of Redis (shared/protocol/streams/stream_head.py), so Redis stays
flat however long the run: ``prompts`` and ``prompts:val`` below what the rollout group needs, ``samples:val`` below
its validator's cursor (a round not yet reported is read again from the file by a restarted driver), ``metrics`` by
time (the trainer's records left to its ``metrics.jsonl`` when that is in this run folder), ``versions`` by time,
keeping the newest few. The driver owns them because it runs where the run folder is; rollout workers never need it."""

from __future__ import annotations

from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.streams import metrics, stream_head, versions


def trimmers(client, keys: Keys, cfg, validator) -> list[stream_head.Trimmer]:
    names = stream_head.NAMES
    trainer_file = metrics.trainer_path(cfg.run_path)

    def val_samples_point(now_ms: int) -> str | None:
        return stream_head.trim_point(validator.cursor, None, now_ms, cfg.stream_keep_s)

    def versions_point(now_ms: int) -> str | None:
        newest = [e.decode() for e, _ in client.xrevrange(keys.versions, count=versions.KEEP_LAST)]
        return versions.trim_point(newest, now_ms, cfg.stream_keep_s)

    small = [
        stream_head.for_run(client, keys.val_prompts, ROLLOUT_GROUP, cfg, names["prompts:val"]),
        stream_head.for_run(client, keys.val_samples, None, cfg, names["samples:val"], point=val_samples_point),
        stream_head.for_run(
            client,
            keys.metrics,
            None,
            cfg,
            names["metrics"],
            store=lambda fields: metrics.to_head(fields, trainer_file.exists()),
        ),
        stream_head.for_run(client, keys.versions, None, cfg, names["versions"], point=versions_point),
    ]
    # trimmed exactly: a few hundred entries a trim, one partly kept node rewritten (~4 kB)
    for trimmer in small:
        trimmer.approximate = False
    return [stream_head.for_run(client, keys.prompts, ROLLOUT_GROUP, cfg, names["prompts"])] + small
