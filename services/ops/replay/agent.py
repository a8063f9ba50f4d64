"""`streamrl replay <agent episode> --continue [--from-call K] [--version V]`: run the user's agent again,
answering its calls before K from the recorded stream and generating call K onward with policy version V.

Writes nothing to the run: the episode's events before call K are copied into a scratch Redis (an embedded
server in a temporary folder), where one rollout worker (loaded with version V) and one gateway serve the
re-run, the same processes as in training. The agent's first K calls are answered from the copied stream
the way a durable re-run is answered (same digest, no generation); call K and what follows are generated
anew. A re-run whose agent asks something else before call K forks, as in training, and the listing says so.
Everything scratch is removed at the end.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from services.ops.launch import starter_client
from shared.protocol.episode.events import decode
from shared.protocol.episode.fold import Episode, fold
from shared.protocol.keys import Keys
from shared.protocol.streams import control
from shared.runtime.connection import connect

SCRATCH_RUN = "replay"


class AgentReplayError(ValueError):
    """Bad input for an agent continuation: which input, what was expected."""


@dataclass
class AgentReplay:
    original: Episode
    rerun: Episode
    from_call: int
    version: int
    reward: float | None
    error: str = ""


def from_call_of(original: Episode, from_call: int | None) -> int:
    """The call a re-run generates from (default: the last), checked against the episode. Pure."""
    if not original.agent:
        raise AgentReplayError(
            f"episode {original.episode_id}: not an agent episode (its started event names no "
            f"agent); --from-call goes with agent episodes, --from-seq with the others"
        )
    calls = sorted(original.calls)
    k = calls[-1] if from_call is None and calls else (from_call or 0)
    if not 0 <= k <= len(calls):
        raise AgentReplayError(
            f"--from-call {k}: episode {original.episode_id} has calls 0..{len(calls) - 1}; "
            f"expected one of them, or {len(calls)} (after the last)"
        )
    return k


def prefix_before_call(entries: list, from_call: int) -> list:
    """The stream entries an agent re-run from call ``from_call`` keeps: everything before that call's ``call``
    event (or every non-terminal entry when ``from_call`` is one past the last call). Pure."""
    kept = []
    for entry_id, fields in entries:
        ev = decode(entry_id, fields)
        if ev.kind in ("finished", "failed") or (ev.kind == "call" and ev.data.get("call") == from_call):
            break
        kept.append((entry_id, fields))
    return kept


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AgentReplayError(f"scratch stack: {what} not ready after {timeout:.0f}s")
        time.sleep(0.1)


def _acked(client, keys: Keys, cmd: str, sync: str) -> bool:
    return any(
        isinstance(e, dict) and e.get("cmd") == cmd and e.get("sync") == sync
        for _, e in control.read_after(client, keys, "0-0", count=10_000)
    )


def continue_agent(
    cfg, entries: list, from_call: int | None, version: int, weights: tuple[str | None, str], model_dir: str, log=print
) -> AgentReplay:
    """Re-run the agent of the episode in ``entries`` from call ``from_call`` (default: its last call) with
    ``version`` (``weights`` = (path or None for the initial model, sha256))."""
    from secrets import token_urlsafe

    import openai

    from services.gateway.runner import load_agent, normalise
    from services.ops.launch.redis_server import EmbeddedRedis

    original = fold(entries)
    k = from_call_of(original, from_call)
    calls = sorted(original.calls)
    keys = Keys(SCRATCH_RUN)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="streamrl-replay-") as tmp:
        # its own: a scratch copy
        server = EmbeddedRedis(Path(tmp) / "redis", password=token_urlsafe(24)).start()
        try:
            client = connect(server.url)
            eid = original.episode_id
            for entry_id, fields in prefix_before_call(entries, k):
                client.xadd(keys.episode(eid), fields, id=entry_id)
            index = {original.calls[i].digest: i for i in calls if i < k}
            client.hset(keys.call_index(eid), mapping={**index, "#n": k})
            port = _free_port()
            env = {
                **os.environ,
                "REDIS_URL": server.url,
                "STREAMRL_RUN": SCRATCH_RUN,
                "STREAMRL_MODEL_DIR": model_dir,
                "STREAMRL_RUN_DIR": str(Path(tmp) / "runs"),
                "STREAMRL_GATEWAY_PORT": str(port),
                "STREAMRL_LOG_LEVEL": "warning",
                "STREAMRL_ENGINE": cfg.engine,
                "STREAMRL_DEVICE": cfg.device,
            }
            root = str(Path(__file__).resolve().parents[3])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
            log(
                f"replay: scratch Redis {server.url}; calls 0..{k - 1} answered from the stream, call {k} on with "
                f"v{version}"
            )
            procs = [
                starter_client.popen(m, extra, env, root)
                for m, extra in (("services.rollout", ["--worker-id", "replay"]), ("services.gateway", []))
            ]
            _wait(lambda: client.exists(keys.alive("rollout", "replay")), 180, "the rollout worker")
            if version != 0 or weights[0]:
                for cmd in ("pause", "load", "resume"):
                    control.send_command(
                        client,
                        keys,
                        control.Command(cmd, "replay", version=version, path=weights[0] or "", sha256=weights[1]),
                    )
                    _wait(lambda: _acked(client, keys, cmd, "replay"), 180, f"the worker's {cmd} of v{version}")
            _wait(lambda: _http_up(port), 120, "the gateway")
            spec = original.events[0].data
            oai = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/ep/{eid}/v1",
                api_key="replay",
                max_retries=3,
                timeout=cfg.agent_timeout,
            )
            reward, error = None, ""
            try:
                reward, _ = normalise(load_agent(spec["agent"])(oai, dict(spec.get("task", {}))))
            # the user's agent: its failure is the replay's finding, not a crash
            except Exception as exc:
                error = f"agent {spec['agent']} raised {exc.__class__.__name__}: {exc}"
            rerun = fold(client.xrange(keys.episode(eid)))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            server.stop()
    return AgentReplay(original, rerun, k, version, reward, error)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_up(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
            return True
    # 401 (an API key is set) still means it is up
    except Exception as exc:
        return getattr(exc, "code", None) is not None


def format_replay(r: AgentReplay, decode_text=None) -> str:
    """Call by call: kept from the stream or generated again, and where the re-run first differs."""
    text = decode_text or (lambda ids: f"{len(ids)} tokens")
    lines = [
        f"agent episode {r.original.episode_id} re-run from call {r.from_call} with v{r.version}: reward "
        f"{r.original.reward} originally, {r.reward if not r.error else r.error} now"
    ]
    for i in sorted(set(r.original.calls) | set(r.rerun.calls)):
        old, new = r.original.calls.get(i), r.rerun.calls.get(i)
        where = "from the stream" if i < r.from_call else "generated again"
        if new is None:
            lines.append(f"  call {i}: not made in the re-run (originally {text(old.tokens)!s})")
            continue
        same = old is not None and old.prompt_ids == new.prompt_ids and old.tokens == new.tokens
        versions = sorted(set(new.versions))
        lines.append(
            f"  call {i} ({where}, v{','.join(map(str, versions)) or '-'}): "
            f"{'same as the original' if same else 'DIFFERS' if old else 'new call'}"
            + ("" if new.extends >= 0 or i == 0 else "; a fork (the agent asked something else)")
        )
        lines.append(f"      {text(new.tokens)!r}" if decode_text else f"      {len(new.tokens)} tokens")
        if old is not None and not same and decode_text:
            lines.append(f"      was {text(old.tokens)!r}")
    return "\n".join(lines)
