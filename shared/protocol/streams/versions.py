"""The ``versions`` stream: one entry per published policy version, written by the trainer, read by the
syncer, rollout workers, the driver and the CLI. Every field is plain text (readable in ``redis-cli``):

    version   policy version number, decimal (1, 2, ...; 0 is the initial weights and is never published)
    path      absolute path of the weights file (safetensors)
    sha256    hex digest of that file (a worker refuses weights that do not match)
    step      optimizer steps taken when the version was made
    time      unix time of the publish, seconds with 3 decimals
    url       optional: where the file can be downloaded (the trainer's weight server, ``weights_port`` > 0): GET with
              Range, ETag = the sha256; absent when the trainer serves none (entries written before it existed
              decode with url "")

Publishing is idempotent: one script appends the entry only when its version is newer than the newest entry's,
so a retried publish (reply lost) or a trainer republishing after a restart adds nothing; readers get strictly
increasing versions with no duplicate.

Where the entries live: who reads them and how far back: the syncer, the announcer and rollout workers
follow the newest (from a cursor, but only the newest entry matters to them: a skipped one is never loaded), the
weight origins the newest ``KEEP_LAST`` (shared/runtime/weights/origins.py), the publish script the newest one;
the whole history only ``streamrl check`` (no version missing or repeated) and ``replay --continue`` of an old
episode (its version's weights path). So the driver moves entries older than ``stream_keep_s`` and beyond the
newest ``KEEP_LAST`` to ``<run>/streams/versions.jsonl`` (``trim_point``; shared/protocol/streams/stream_head.py), and
``read_all(..., run_path)`` reads that file, then Redis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.protocol.episode.errors import EventError
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, once, stream_head

_PUBLISH = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'version' and tonumber(f[i + 1]) and tonumber(f[i + 1]) >= tonumber(ARGV[2]) then
      return {0, last[1][1]}
    end
  end
end
return {1, redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))}
"""

# entries always left in Redis: the weight origins read this many (RECENT_VERSIONS, a test checks)
KEEP_LAST = 16
FIELDS = ("version", "path", "sha256", "step", "time", "url")


@dataclass(frozen=True)
class Version:
    version: int
    path: str
    sha256: str = ""
    step: int = 0
    time: float = 0.0
    entry_id: str = ""
    url: str = ""


def encode(v: Version) -> dict[str, str]:
    fields = {
        "version": str(v.version),
        "path": v.path,
        "sha256": v.sha256,
        "step": str(v.step),
        "time": f"{v.time or time.time():.3f}",
    }
    return {**fields, "url": v.url} if v.url else fields


def decode(entry_id, fields: dict) -> Version:
    """A versions entry as a Version; EventError naming the entry and field when malformed."""
    entry_id = codec.text(entry_id)
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    try:
        version = int(f["version"])
    except KeyError:
        raise EventError(entry_id, "version", "missing") from None
    except ValueError:
        raise EventError(entry_id, "version", f"expected an integer, got {f['version']!r}") from None
    if version < 0:
        raise EventError(entry_id, "version", f"expected an integer >= 0, got {version}")
    if not f.get("path"):
        raise EventError(entry_id, "path", "missing weights path")
    try:
        step, at = int(f.get("step", "0")), float(f.get("time", "0"))
    except ValueError:
        raise EventError(
            entry_id, "step", f"expected an integer step and a float time, got {f.get('step')!r}, {f.get('time')!r}"
        ) from None
    return Version(version, f["path"], f.get("sha256", ""), step, at, entry_id, f.get("url", ""))


def publish(client, keys: Keys, v: Version) -> str:
    """Append ``v`` unless the newest entry already has this version or a later one (then a no-op, logged at
    debug); returns the entry id of ``v`` or of that newer entry."""
    flat = [x for kv in encode(v).items() for x in kv]
    added, entry_id = client.eval(_PUBLISH, 1, keys.versions, "", v.version, *flat)
    if not int(added):
        once.skipped("versions", version=v.version, newest_entry=codec.text(entry_id))
    return codec.text(entry_id)


def latest(client, keys: Keys) -> Version | None:
    """The newest published version, or None when nothing was published yet."""
    last = client.xrevrange(keys.versions, count=1)
    return decode(*last[0]) if last else None


def latest_number(client, keys: Keys) -> int:
    v = latest(client, keys)
    return v.version if v else 0


def trim_point(newest_ids: list[str], now_ms: int, keep_s: float, keep_last: int = KEEP_LAST) -> str | None:
    """The MINID of the versions stream (pure): below the oldest of its newest ``keep_last`` entries (``newest_ids``,
    newest first, as XREVRANGE COUNT keep_last gives them) and older than ``keep_s``; None while it has no more."""
    if len(newest_ids) < keep_last:
        return None
    return min(newest_ids[keep_last - 1], stream_head.window_point(now_ms, keep_s), key=stream_head.id_key)


def head_path(run_path):
    return stream_head.path_of(run_path, stream_head.NAMES["versions"])


def read_all(client, keys: Keys, run_path=None) -> list[Version]:
    """Every published version; with ``run_path``, those moved to its head file first."""
    entries = (
        stream_head.read_all(client, keys.versions, head_path(run_path))
        if run_path is not None
        else client.xrange(keys.versions)
    )
    return [decode(entry_id, fields) for entry_id, fields in entries]


def read_after(client, keys: Keys, cursor: str, block_ms: int | None = None, count: int = 100) -> list[Version]:
    """Entries after ``cursor`` (an entry id), waiting up to ``block_ms`` for one when none is there."""
    reply = client.xread({keys.versions: cursor}, count=count, block=block_ms)
    return [decode(entry_id, fields) for _, entries in reply or [] for entry_id, fields in entries]
