"""The episode page's data (pure): an episode as `streamrl replay --json` has it (``views.timeline_json``), plus
each token's text and where the markers fall, so the page draws tokens and markers without counting anything.

Markers (``kind``: aborted, resumed, takeover, repacked, tool_call, tool_result) carry ``at``: the response
token they stand before (the abort's and resume's ``num_tokens``; a tool call where its tokens end, a tool result
where its masked tokens start), and ``seq``, the event to continue from (`streamrl replay --continue --from-seq`).
"""

from __future__ import annotations

import shlex

from services.ops.inspect.views import timeline_json
from shared.protocol.episode.fold import Episode


def resume_kind(r: dict) -> str:
    return "takeover" if r.get("takeover_from") else "repacked" if r.get("repacked") else "resumed"


def markers(aborts: list[dict], resumes: list[dict]) -> list[dict]:
    """The abort and resume markers of an episode (or of one agent call), in stream order."""
    out = [
        {
            "kind": "aborted",
            "at": a["num_tokens"],
            "seq": a["seq"],
            "worker": a["worker"],
            "version": a["version"],
            "why": a["reason"],
        }
        for a in aborts
    ]
    out += [
        {
            "kind": resume_kind(r),
            "at": r["num_tokens"],
            "seq": r["seq"],
            "worker": r["worker"],
            "version": r["version"],
            "why": r.get("takeover_from") or r.get("repacked") or "",
        }
        for r in resumes
    ]
    return sorted(out, key=lambda m: m["seq"])


def tool_markers(events: list[dict]) -> list[dict]:
    """Tool calls and results at their place in the response (a walk of the events' token counts)."""
    at, out = 0, []
    for ev in events:
        d = ev["data"]
        if ev["kind"] == "tokens" and "call" not in d:
            at += len(d["ids"])
        elif ev["kind"] == "tool_call":
            out.append(
                {
                    "kind": "tool_call",
                    "at": at,
                    "seq": ev["seq"],
                    "worker": ev["worker"],
                    "version": ev["policy"],
                    "why": f"{d['name']}({d['args']})",
                }
            )
        elif ev["kind"] == "tool_result":
            out.append(
                {
                    "kind": "tool_result",
                    "at": at,
                    "seq": ev["seq"],
                    "worker": ev["worker"],
                    "version": ev["policy"],
                    "why": ("ok: " if d["ok"] else "ERROR: ") + str(d["output"]),
                    "length": len(d["ids"]),
                }
            )
            at += len(d["ids"])
    return out


def replay_command(run: str, episode_id: str, agent: bool, point: int | None = None) -> str:
    base = ["streamrl", "replay", episode_id, "--run", run, "--continue"]
    if point is not None:
        base += ["--from-call" if agent else "--from-seq", str(point)]
    return shlex.join(base)


def pieces(ids: list[int], decode_one) -> list[str]:
    return [decode_one(i) for i in ids] if decode_one else [str(i) for i in ids]


def episode_view(ep: Episode, run: str, decode_text=None) -> dict:
    """Everything the episode page shows: the replay JSON (unchanged, under ``replay``) and the drawing aids."""
    one = (lambda i: decode_text([i])) if decode_text else None
    replay = timeline_json(ep, decode_text)
    agent = ep.agent is not None
    view = {
        "replay": replay,
        "run": run,
        "agent": agent,
        "prompt_pieces": pieces(ep.prompt_ids, one),
        "pieces": pieces(ep.tokens, one),
        "markers": sorted(
            markers(ep.aborts, ep.resumes) + tool_markers(replay["events"]), key=lambda m: (m["at"], m["seq"])
        ),
        "command": replay_command(run, ep.episode_id, agent),
        "commands": {},
        # a mixture-of-experts episode's logged experts per response token (the page colours by how many layers
        # another version's routers would change: ``?routes_under=V``)
        "routes": [None if r is None else r.tolist() for r in ep.routes] if ep.routes else None,
    }
    if agent:
        view["calls"] = [
            {
                "index": c.index,
                "extends": c.extends,
                "fork": c.extends < 0 and c.index > 0,
                "prompt_pieces": pieces(c.prompt_ids, one),
                "new_from": len(c.prompt_ids) - len(c.new_ids) if c.extends >= 0 else 0,
                "pieces": pieces(c.tokens, one),
                "tokens": c.tokens,
                "versions": c.versions,
                "logprobs": c.logprobs,
                "markers": markers(c.aborts, c.resumes),
                "done": c.done,
                "reason": c.reason,
                "worker": c.worker,
                "command": replay_command(run, ep.episode_id, True, c.index),
            }
            for c in (ep.calls[i] for i in sorted(ep.calls))
        ]
    else:
        view["commands"] = {
            str(ev.seq): replay_command(run, ep.episode_id, False, ev.seq)
            for ev in ep.events
            if ev.kind not in ("finished", "failed")
        }
    return view
