"""The live view of a run (the driver's progress line and `streamrl status`), read from Redis (a newest record
older than the metrics stream's window in Redis: from the end of the run folder's files, a bounded read).

``snapshot`` gathers the numbers; ``format_line`` is pure. Rates come from stream entry ids (their millisecond
timestamps), so any process, started at any time, shows the same view.
"""

from __future__ import annotations

import time
from collections import Counter

from shared.protocol.archive import tiers
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, metrics, samples, versions

_last = metrics.last


def alive_services(client, keys: Keys) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in client.scan_iter(match=keys.alive_pattern(), count=10_000):
        service = keys.alive_name(k).split(":", 1)[0]
        out[service] = out.get(service, 0) + 1
    return out


def samples_per_s(client, keys: Keys, window_s: float = 30.0) -> float:
    """Finished episodes per second over the last ``window_s`` seconds (from the samples stream's entry ids)."""
    now_ms = int(time.time() * 1000)
    entries = samples.read_since(client, keys.samples, now_ms - int(window_s * 1000))
    if not entries:
        return 0.0
    first_ms = samples.entry_ms(entries[0].entry_id)
    span = max((now_ms - first_ms) / 1000, 1.0) if len(entries) > 1 else window_s
    return sum(s.n for s in entries) / span


WIRE = (
    "fetched_bytes",
    "delta_bytes",
    "delta_full_bytes",
    "delta_versions",
    "delta_fallbacks",
    "delta_missing",
    "delta_fetch_s",
    "delta_apply_s",
)


def weights_wire(published: list[dict], rollout: list[dict]) -> dict:
    """Weights on the wire, pure: from the trainer's ``publish`` records, the versions with a delta, the
    newest one's size as a fraction of its file and over the entropy floor; from each rollout worker's newest record,
    bytes downloaded in all and as deltas (with the full bytes those deltas stood for), fallbacks, the longest chain."""
    deltas = [r for r in published if not r.get("snapshot", True)]
    out: dict = {"versions": len(published), "deltas": len(deltas)}
    if deltas:
        last = deltas[-1]
        out.update(
            last_version=last["version"],
            last_fraction=last["delta_bytes"] / max(1, last["full_bytes"]),
            last_over_floor=last["delta_bytes"] / last["floor_bytes"] if last.get("floor_bytes") else None,
        )
    newest: dict[str, dict] = {}
    for r in rollout:
        newest[r.get("worker", "")] = r
    for key in WIRE:
        out[key] = sum(r.get(key, 0) for r in newest.values())
    out["delta_chain_max"] = max((r.get("delta_chain_max", 0) for r in newest.values()), default=0)
    return out


def agent_failures(client, keys: Keys, scan: int = 2000) -> dict | None:
    """Agent runs: episodes ended so far (``agents:ended``: finished, failed) and, among the ``agent`` records in the
    newest ``scan`` metrics entries, how many failed and their most common error (``short_error``); None
    when no agent episode has ended."""
    ended = {codec.text(k): int(v) for k, v in client.hgetall(keys.agents_ended).items()}
    if not ended:
        return None
    recent = [r for _, r in metrics.read(client, keys, "agent", newest_first=True, count=scan)]
    errors = Counter(short_error(r["error"]) for r in recent if r.get("status") == "failed" and r.get("error"))
    top, count = errors.most_common(1)[0] if errors else ("", 0)
    return {
        "finished": ended.get("finished", 0),
        "failed": ended.get("failed", 0),
        "recent": len(recent),
        "recent_failed": sum(r.get("status") == "failed" for r in recent),
        "top_error": top,
        "top_count": count,
    }


def short_error(error: str, width: int = 80) -> str:
    """An episode's error on one line, its first ``width`` characters, without the runner's ``agent <spec> raised``
    (the same on every line of a run)."""
    if error.startswith("agent ") and " raised " in error:
        error = error.split(" raised ", 1)[1]
    return " ".join(error.split())[:width]


def failures_words(a: dict | None) -> str:
    """``failed 812/812 episodes (recent 500 of 500, most: 500x NotFoundError: ...)`` (pure); '' when no
    agent episode failed."""
    if not a or not a["failed"]:
        return ""
    words = f"failed {a['failed']}/{a['failed'] + a['finished']} episodes"
    if a["top_error"]:
        words += f" (recent {a['recent_failed']} of {a['recent']}, most: {a['top_count']}x {a['top_error']})"
    return words


def snapshot(client, keys: Keys, run_path=None) -> dict:
    """The numbers of the view; ``run_path`` (the run's folder): where its segments are, if on this machine."""
    published = [r for _, r in metrics.read(client, keys, "publish", newest_first=True, count=2000)]
    rollout = [r for _, r in metrics.read(client, keys, "rollout", newest_first=True, count=500)]
    # the newest train / validation / sync record: from Redis's recent window, else from the run's files' ends
    return {
        "version": versions.latest_number(client, keys),
        "train": _last(client, keys, "train", run_path=run_path) or {},
        "validation": _last(client, keys, "validation", run_path=run_path),
        "sync": _last(client, keys, "sync", run_path=run_path),
        "samples_per_s": samples_per_s(client, keys),
        "alive": alive_services(client, keys),
        "dead_letters": client.xlen(keys.dead_letters),
        "agents": agent_failures(client, keys),
        "weights": weights_wire(published[::-1], rollout[::-1]),
        "tiers": tiers.sizes(client, run_path),
        # one every snapshot_every_versions: further back than the other kinds' newest (a few records a version)
        "trainer_snapshot": metrics.last(client, keys, "snapshot", scan=500, run_path=run_path),
        "now": time.time(),
    }


def snapshot_words(snap: dict | None, version: int, now: float) -> str:
    """``snapshot v25 41 s ago, a crash re-trains 3 versions`` (pure): the trainer's newest snapshot on disk and how
    many versions a restart would train again from the log; '' before the first."""
    if not snap:
        return ""
    behind = max(0, version - int(snap.get("version", 0)))
    age = max(0.0, now - float(snap.get("time", now)))
    return f"snapshot v{snap.get('version')} {age:.0f} s ago, a crash re-trains {behind} version{'s' * (behind != 1)}"


def format_line(s: dict) -> str:
    m, val, sync = s["train"], s["validation"], s["sync"]
    parts = [
        f"version {s['version']:3d}",
        f"step {m.get('step', 0):4d}",
        f"reward {m.get('reward_mean', float('nan')):.3f}",
    ]
    # why a reward can be 0 whatever the reward function says
    if m.get("batch_policy_failures"):
        parts[-1] += (
            f" ({m['batch_policy_failures']}/{m.get('samples', '?')} cut short by max_tokens, the context "
            f"or max_tool_calls: scored 0)"
        )
    if val:
        parts.append(f"val@v{val['version']} {val['reward_mean']:.3f} (greedy {val['reward_greedy']:.3f})")
    parts += [
        f"samples/s {s['samples_per_s']:5.1f}",
        *filter(None, [failures_words(s.get("agents"))]),
        f"staleness max {m.get('staleness_max', 0)}",
        f"dropped {m.get('stale_dropped', 0)}",
    ]
    if sync:
        parts.append(f"last sync {sync.get('total_s', 0) * 1000:.0f} ms")
    w = s.get("weights") or {}
    if w.get("deltas"):
        floor = f", {w['last_over_floor']:.2f}x the floor" if w.get("last_over_floor") else ""
        parts.append(
            f"weights as deltas: v{w['last_version']} {100 * w['last_fraction']:.2f}% of the file{floor}; "
            f"workers got {w['delta_versions']} versions in {w['delta_bytes'] / 1e6:.1f} MB for "
            f"{w['delta_full_bytes'] / 1e6:.1f} MB, {w['delta_fallbacks']} fallbacks"
        )
    if words := snapshot_words(s.get("trainer_snapshot"), s["version"], s.get("now", time.time())):
        parts.append(words)
    parts.append(f"rollout workers {s['alive'].get('rollout', 0)}")
    if s.get("tiers"):
        parts.append(tiers.describe(s["tiers"]))
    if s["dead_letters"]:
        parts.append(f"dead letters {s['dead_letters']}")
    return "  ".join(parts)
