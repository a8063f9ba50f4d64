"""What `streamrl inspect` and `streamrl replay` show: pure formatting over Redis reads."""

from __future__ import annotations

from collections import Counter

import redis

from shared.protocol.episode.fold import Episode
from shared.protocol.keys import Keys
from shared.protocol.streams import codec


def run_streams(client: redis.Redis, keys: Keys) -> list[dict]:
    """Every stream of a run with its length and consumer groups."""
    out = []
    found = {k for pattern in keys.patterns for k in client.scan_iter(match=pattern, count=1000, _type="stream")}
    for key in sorted(found):
        groups = [
            {"name": codec.text(g["name"]), "consumers": g["consumers"], "pending": g["pending"], "lag": g.get("lag")}
            for g in client.xinfo_groups(key)
        ]
        out.append({"key": codec.text(key), "length": client.xlen(key), "groups": groups})
    return out


def format_streams(streams: list[dict], keys: Keys, list_episodes: bool = False) -> str:
    episodes = [s for s in streams if keys.is_episode(s["key"])]
    others = [s for s in streams if s not in episodes]
    lines = [f"run {keys.run!r}: {len(others)} streams, {len(episodes)} episode streams"]
    width = max([len(s["key"]) for s in (streams if list_episodes else others)] + [10])
    for s in others + (episodes if list_episodes else []):
        lines.append(f"  {s['key']:<{width}}  length {s['length']}")
        for g in s["groups"]:
            lag = "" if g["lag"] is None else f", lag {g['lag']}"
            lines.append(
                f"  {'':<{width}}    group {g['name']}: {g['consumers']} consumers, {g['pending']} pending{lag}"
            )
    if episodes and not list_episodes:
        total = sum(s["length"] for s in episodes)
        lines.append(
            f"  {keys.episode('*'):<{width}}  {len(episodes)} streams, {total} entries (--episodes lists them)"
        )
    return "\n".join(lines)


def _describe(ev, decode_text) -> str:
    d = ev.data
    if ev.kind == "started":
        text = f"  {decode_text(d['prompt_ids'])!r}" if decode_text else ""
        return (
            f"prompt {len(d['prompt_ids'])} tokens, group {d['group_id']} #{d['index']}, "
            f"max_tokens {d['sampling'].get('max_tokens')}{text}"
        )
    if "call" in d and ev.kind in ("tokens", "aborted", "resumed"):
        return f"call {d['call']}: " + _describe(
            type(ev)(ev.kind, ev.policy, ev.worker, ev.seq, {k: v for k, v in d.items() if k != "call"}), decode_text
        )
    if ev.kind == "call":
        base = "whole prompt" if d["extends"] < 0 else f"extends call {d['extends']} by"
        text = f"  {decode_text(d['prompt_ids'])!r}" if decode_text else ""
        return (
            f"call {d['call']}: {base} {len(d['prompt_ids'])} tokens, max_tokens "
            f"{d['sampling'].get('max_tokens')}{text}"
        )
    if ev.kind == "call_done":
        return f"call {d['call']}: {d['reason']}, {d['num_tokens']} tokens"
    if ev.kind == "tokens":
        text = f"  {decode_text(d['ids'])!r}" if decode_text else ""
        return f"{len(d['ids'])} tokens{text}"
    if ev.kind == "aborted":
        return f"{d['reason']} at {d['num_tokens']} tokens"
    if ev.kind == "resumed":
        takeover = f", takeover from {d['takeover_from']}" if d.get("takeover_from") else ""
        repacked = f", repacked from {d['repacked']}" if d.get("repacked") else ""
        return f"at {d['num_tokens']} tokens{takeover}{repacked}"
    if ev.kind == "tool_call":
        return f"{d['call_id']} {d['name']}({d['args']})"
    if ev.kind == "tool_result":
        return f"{d['call_id']} {'ok' if d['ok'] else 'ERROR'} {d['output']!r} ({len(d['ids'])} tokens)"
    if ev.kind == "finished":
        return f"{d['reason']}, reward {d['reward']:.3f} {d.get('details') or ''}".rstrip()
    return f"{d['error']} ({d.get('where', '?')})"


def format_timeline(ep: Episode, decode_text=None, routes: bool = False, under=None) -> str:
    t0 = ep.events[0].time_ms
    by_version = Counter(v for v, m in zip(ep.versions, ep.mask) if m)
    lines = [
        f"episode {ep.episode_id}  group {ep.group_id} #{ep.index}  status {ep.status}"
        + (f" ({ep.finish_reason}), reward {ep.reward:.3f}" if ep.status == "finished" else "")
        + (f": {ep.error}" if ep.error else ""),
        f"{'seq':>4}  {'+ms':>7}  {'worker':<14} {'policy':>6}  event",
    ]
    for ev in ep.events:
        lines.append(
            f"{ev.seq:>4}  {ev.time_ms - t0:>7}  {ev.worker[:14]:<14} {'v' + str(ev.policy):>6}  "
            f"{ev.kind:<11} {_describe(ev, decode_text)}"
        )
    versions = " ".join(f"v{v}:{n}" for v, n in sorted(by_version.items()))
    lines.append(
        f"response: {len(ep.tokens)} tokens, {ep.num_generated} generated ({versions or 'none'}), "
        f"{len(ep.tokens) - ep.num_generated} from tools; {len(ep.aborts)} aborts, {len(ep.resumes)} resumes"
    )
    if ep.calls:
        lines += format_calls(ep, decode_text)
    if decode_text:
        lines.append(f"text: {decode_text(ep.prompt_ids)!r} + {decode_text(ep.tokens)!r}")
    lines += format_routes(ep, decode_text, routes, under)
    return "\n".join(lines)


def format_routes(ep: Episode, decode_text=None, each: bool = False, under=None) -> list[str]:
    """A line on the episode's expert routes (a mixture-of-experts policy); ``each``: a line per routed token, its
    experts layer by layer (``|`` between layers); ``under``: (label, routes, layers changed per token) of another
    version's routers (services/ops/replay/routes.py), shown after the logged ones."""
    held = [(j, r) for j, r in enumerate(ep.routes) if r is not None]
    if not held:
        return ["routes: none logged (a dense policy, or routing_replay off)"] if each else []
    layers, k = held[0][1].shape
    lines = [f"routes: {len(held)} of {len(ep.tokens)} response tokens, {layers} MoE layers x top-{k}"]
    if each:
        head = f"{'token':>6}  {'id':>6}  {'policy':>6}  {'text':<10}  experts per layer"
        lines.append(head + (f"  ->  under {under[0]} (layers changed)" if under else ""))
        for j, r in held:
            text = repr(decode_text([ep.tokens[j]])) if decode_text else ""
            row = f"{j:>6}  {ep.tokens[j]:>6}  {'v' + str(ep.versions[j]):>6}  {text[:10]:<10}  {_experts(r)}"
            lines.append(row + (f"  ->  {_experts(under[1][j])} ({under[2][j]})" if under else ""))
    if under:
        from services.ops.replay.routes import summary

        lines.append(summary(under[0], under[2]))
    return lines


def _experts(route) -> str:
    return " | ".join(",".join(str(int(e)) for e in layer) for layer in route)


def format_calls(ep: Episode, decode_text=None) -> list[str]:
    """An agent episode call by call: how each prompt came about, what was generated under which versions,
    aborts, resumes, forks; then how the calls train (one row per chain)."""
    lines = [
        f"agent {ep.agent}: {len(ep.calls)} calls, {len(ep.rows)} training row(s)"
        + (f" ({len(ep.branches)} forked)" if ep.branches else "")
    ]
    for i in sorted(ep.calls):
        c = ep.calls[i]
        how = (
            "fork: whole prompt"
            if c.extends < 0 and i > 0
            else ("whole prompt" if c.extends < 0 else f"extends call {c.extends} + {len(c.new_ids)} masked tokens")
        )
        versions = " ".join(f"v{v}:{n}" for v, n in sorted(Counter(c.versions).items()))
        lines.append(
            f"  call {i}: {how}; prompt {len(c.prompt_ids)} tokens; {len(c.tokens)} generated "
            f"({versions or 'none'}); {len(c.aborts)} aborts, {len(c.resumes)} resumes; "
            f"{c.reason if c.done else 'in flight'}"
        )
        if decode_text:
            if c.extends >= 0:
                lines.append(f"    new: {decode_text(c.new_ids)!r}")
            lines.append(f"    out: {decode_text(c.tokens)!r}")
    return lines


def _json_data(data: dict) -> dict:
    """An event's payload as JSON has it: routes as their shape (``routes``: the per-token list, on request)."""
    if "routes" not in data:
        return dict(data)
    n, layers, k = data["routes"].shape
    return {**data, "routes": {"tokens": n, "layers": layers, "k": k}}


def timeline_json(ep: Episode, decode_text=None, routes: bool = False, under=None) -> dict:
    out = {
        k: getattr(ep, k)
        for k in (
            "episode_id",
            "group_id",
            "index",
            "status",
            "finish_reason",
            "reward",
            "reward_details",
            "error",
            "prompt_ids",
            "sampling",
            "task",
            "tokens",
            "logprobs",
            "versions",
            "mask",
            "tool_calls",
            "tool_results",
            "aborts",
            "resumes",
            "agent",
        )
    }
    out["calls"] = [
        {
            "index": c.index,
            "extends": c.extends,
            "prompt_ids": c.prompt_ids,
            "tokens": c.tokens,
            "versions": c.versions,
            "aborts": c.aborts,
            "resumes": c.resumes,
            "done": c.done,
            "reason": c.reason,
            "messages": c.messages,
        }
        for c in ep.calls.values()
    ]
    out["events"] = [
        {
            "entry_id": ev.entry_id,
            "seq": ev.seq,
            "kind": ev.kind,
            "policy": ev.policy,
            "worker": ev.worker,
            "time_ms": ev.time_ms,
            "data": _json_data(ev.data),
        }
        for ev in ep.events
    ]
    if routes:
        out["routes"] = [None if r is None else r.tolist() for r in ep.routes]
    if under:
        label, other, moved = under
        out["routes_under"] = {
            "version": label,
            "routes": [None if r is None else r.tolist() for r in other],
            "layers_changed": moved,
        }
    if decode_text:
        out["prompt_text"], out["response_text"] = decode_text(ep.prompt_ids), decode_text(ep.tokens)
    return out
