"""`streamrl replay <episode> --continue`: re-run an episode's continuation from
any of its events with a chosen policy version, for debugging.

    entries --prefix_at(seq)--> Prefix --continue_from(engine)--> Continuation

``prefix_at`` is pure: it folds the events up to and including ``from_seq``
and says what the model would continue from (prompt + response so far), with
which sampling parameters, remaining budget and sampling position. The
continuation drives an in-process engine exactly like the rollout worker does
(same seed, ``start_index`` = response tokens so far, so the same weights give
the same tokens), runs tool calls in-process (same parser and tools as the rq
jobs, with ``tool_timeout``) and scores the result with the reward function.

It writes nothing to Redis: the original episode's stream is the record of
what happened and is never touched; the continuation is printed only.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from services.rollout.engine import EngineError, SamplingParams
from services.rollout.episodes.agent_loop import Agent, Finish, ToolCall
from services.rollout.episodes.live import LiveEpisode, index_after_seq
from services.rollout.jobs import rewards, tools
from shared.protocol.episode.events import TERMINAL_KINDS, decode
from shared.protocol.episode.fold import PROMPT_VERSION, Episode, fold
from shared.protocol.streams.versions import Version
from shared.runtime.weights import chain


class ContinuationError(ValueError):
    """Bad input for a continuation: which input, what was expected."""


@dataclass
class Prefix:
    # folded up to and including from_seq
    episode: Episode
    from_seq: int
    # of the whole stream
    last_seq: int
    # policy version in effect at event from_seq
    policy: int
    params: SamplingParams
    # index in episode.tokens where the current generation turn began
    turn_start: int

    @property
    def context_ids(self) -> list[int]:
        return self.episode.context_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.episode.num_generated

    @property
    def pending_call(self) -> dict | None:
        pending = self.episode.pending_tool_calls
        return pending[-1] if pending else None


@dataclass
class Continuation:
    from_seq: int
    # policy version of the weights that generated the new tokens
    version: int
    # response tokens kept from the stream
    prefix_tokens: int
    # new response tokens (tool output included)
    tokens: list[int] = field(default_factory=list)
    # 0.0 for tool output
    logprobs: list[float] = field(default_factory=list)
    # per new token; -1 for tool output
    versions: list[int] = field(default_factory=list)
    # 1 = generated, 0 = tool output
    mask: list[int] = field(default_factory=list)
    # {call_id, name, args, ok, output}
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = ""
    reward: float | None = None
    reward_details: dict = field(default_factory=dict)
    # reward function or engine failure
    error: str | None = None

    @property
    def num_generated(self) -> int:
        return sum(self.mask)

    def add(self, ids: list[int], logprobs: list[float], version: int, generated: int) -> None:
        self.tokens += ids
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.mask += [generated] * len(ids)


def prefix_at(entries, from_seq: int | None = None) -> Prefix:
    """The state after event ``from_seq`` (default: the last non-terminal event)."""
    if not entries:
        raise ContinuationError("empty stream: no such episode")
    events = [decode(*e) if isinstance(e, tuple) else e for e in entries]
    # validates the whole stream first (gaps, duplicates, schema)
    full = fold(events)
    last = full.last_seq
    if from_seq is None:
        from_seq = last - 1 if full.done else last
    if not 0 <= from_seq <= last:
        raise ContinuationError(
            f"--from-seq {from_seq}: out of range; episode {full.episode_id} holds events 0..{last}"
        )
    kind = events[from_seq].kind
    if kind in TERMINAL_KINDS:
        raise ContinuationError(
            f"--from-seq {from_seq}: that is the episode's {kind!r} event; continue from an "
            f"event before it (0..{from_seq - 1})"
        )
    ep = fold(events[: from_seq + 1])
    params = SamplingParams.from_dict(ep.sampling)
    turn_start = index_after_seq(ep, ep.tool_results[-1]["seq"]) if ep.tool_results else 0
    return Prefix(ep, from_seq, last, events[from_seq].policy, params, turn_start)


def resolve_version(published: list[Version], version: int, model_dir: str) -> tuple[str | None, str]:
    """(weights path, sha256) of a policy version: None for version 0 (the
    weights in ``model_dir``), else the entry of the ``versions`` stream."""
    if version == 0:
        return None, ""
    for v in published:
        if v.version == version:
            path = Path(v.path)
            # published as a delta: its file made from the chain in the trainer's folder
            if not path.exists() and chain.can_make(path.parent, version):
                try:
                    chain.make(path.parent, version, v.sha256)
                except (chain.ChainError, OSError) as exc:
                    raise ContinuationError(f"--version {version}: {exc}") from None
            if not path.exists():
                raise ContinuationError(
                    f"--version {version}: its weights file {v.path} no longer exists (pruned "
                    f"by the trainer?); pass --weights PATH or another version"
                )
            return v.path, v.sha256
    known = sorted(v.version for v in published)
    if not known:
        listed = "none yet (0 is model_dir)"
    elif known == list(range(known[0], known[-1] + 1)):
        listed = f"{known[0]} to {known[-1]} (0 is model_dir)"
    else:
        listed = ", ".join(map(str, known[-10:])) + (", ..." if len(known) > 10 else "") + " (0 is model_dir)"
    raise ContinuationError(f"--version {version}: unknown policy version; published versions: {listed}")


def load_version(engine, version: int, path: str | None, sha256: str = "") -> None:
    """Put ``path``'s weights (checked against ``sha256`` when given) into the engine, tagged ``version``."""
    if path is None:
        engine.version = version
        return
    if sha256:
        from shared.runtime.weights.checksum import sha256_file

        actual = sha256_file(Path(path))
        if actual != sha256:
            raise ContinuationError(
                f"weights {path}: sha256 {actual[:12]}... does not match the published "
                f"{sha256[:12]}... (corrupt or truncated file)"
            )
    try:
        engine.load_weights(path, version)
    except EngineError as exc:
        raise ContinuationError(f"--weights {path}: {exc}") from None


def _run_tool_inline(tools_config: str, name: str, args: str, timeout: float) -> tuple[bool, str]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        output = pool.submit(tools.run_tool, tools_config, name, args).result(timeout=timeout)
        return True, output
    except concurrent.futures.TimeoutError:
        return False, f"tool timed out after {timeout:g}s"
    # a tool can raise anything; the rq path reports the last line of it
    except Exception as exc:
        return False, f"{exc.__class__.__name__}: {exc}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def continue_from(
    prefix: Prefix,
    engine,
    tokenizer,
    reward_fn: Callable,
    tools_config: str | Iterable[str] = "",
    max_tool_calls: int = 4,
    tool_timeout: float = 10.0,
    request_id: str = "continuation",
) -> Continuation:
    """Generate from ``prefix`` with the engine's current weights until the episode ends (stop, budget, context,
    tool limit), driven by the same agent loop as the rollout worker, tool calls run in-process.
    ``tools_config``: the config key ``tools`` (or an iterable of its items)."""
    if not isinstance(tools_config, str):
        tools_config = ",".join(sorted(tools_config))
    ep = prefix.episode
    live = LiveEpisode.from_fold(ep, prefix.params)
    agent = Agent(tokenizer, tools.registry(tools_config), max_tool_calls, engine.max_model_len)
    out = Continuation(prefix.from_seq, engine.version, len(ep.tokens))

    def generated(chunk) -> None:
        agent.add_generated(live, chunk.token_ids)
        out.add(chunk.token_ids, chunk.logprobs, chunk.version, 1)

    def answer(call: ToolCall) -> None:
        ok, output = (
            (False, call.error)
            if call.error is not None
            else _run_tool_inline(tools_config, call.name, call.args, tool_timeout)
        )
        out.tool_calls.append(
            {"call_id": call.call_id, "name": call.name, "args": call.args, "ok": ok, "output": output}
        )
        ids = agent.result_ids(ok, output)
        agent.add_result(live, ids)
        out.add(ids, [0.0] * len(ids), PROMPT_VERSION, 0)

    pending = prefix.pending_call
    # the stream stopped between a call and its result: answer it first
    if pending is not None:
        answer(agent.checked(ToolCall(pending["call_id"], pending["name"], pending["args"])))
    finish = None
    while finish is None:
        end = agent.next_turn(live)
        if end is not None:
            finish = end.reason
            break
        try:
            engine.add_request(request_id, live.context_ids, live.params, live.remaining, start_index=len(live.tokens))
        except EngineError as exc:
            out.error, finish = f"engine: {exc}", "failed"
            break
        step = None
        # one generation turn
        while step is None:
            for chunk in engine.step():
                if chunk.request_id != request_id:
                    continue
                generated(chunk)
                step = agent.after_chunk(live, chunk.finish_reason)
                # a call (or the tool limit) ends the turn
                if step is not None and chunk.finish_reason is None:
                    rest = engine.abort(request_id)
                    if rest is not None:
                        generated(rest)
        if isinstance(step, Finish):
            finish = step.reason
        else:
            answer(step)
    out.finish_reason = finish
    if finish != "failed":
        text = tokenizer.decode(live.tokens, skip_special_tokens=True)
        prompt = tokenizer.decode(live.prompt_ids, skip_special_tokens=True)
        try:
            out.reward, out.reward_details = rewards.score(getattr(reward_fn, "fn", reward_fn), text, ep.task, prompt)
        # a user's reward function can raise anything
        except Exception as exc:
            out.error = f"reward function raised {exc.__class__.__name__}: {exc}"
    return out


def as_dict(prefix: Prefix, result: Continuation, decode_text=None) -> dict:
    out = {
        "episode_id": prefix.episode.episode_id,
        "from_seq": result.from_seq,
        "stream_last_seq": prefix.last_seq,
        "policy_at_event": prefix.policy,
        "version": result.version,
        "prefix_tokens": result.prefix_tokens,
        "tokens": result.tokens,
        "logprobs": result.logprobs,
        "versions": result.versions,
        "mask": result.mask,
        "tool_calls": result.tool_calls,
        "finish_reason": result.finish_reason,
        "reward": result.reward,
        "reward_details": result.reward_details,
        "error": result.error,
    }
    if decode_text:
        out["prefix_text"] = decode_text(prefix.episode.tokens)
        out["text"] = decode_text(result.tokens)
    return out


def format_result(
    prefix: Prefix, result: Continuation, label: str, original: Episode | None = None, decode_text=None
) -> str:
    ep = prefix.episode
    lines = [
        f"continuation of episode {ep.episode_id} from seq {result.from_seq} ({ep.events[-1].kind}, "
        f"policy v{prefix.policy}) of 0..{prefix.last_seq}, weights {label}; nothing written to Redis",
        f"prefix: {len(ep.prompt_ids)} prompt + {result.prefix_tokens} response tokens "
        f"({ep.num_generated} generated), budget left {prefix.remaining}",
    ]
    versions = sorted({v for v, m in zip(result.versions, result.mask) if m})
    lines.append(
        f"continued: {len(result.tokens)} tokens, {result.num_generated} generated "
        f"(versions {', '.join(f'v{v}' for v in versions) or 'none'}), "
        f"{len(result.tool_calls)} tool calls"
    )
    for c in result.tool_calls:
        lines.append(
            f"  tool {c['call_id']} {c['name']}({c['args']}) -> {'ok' if c['ok'] else 'ERROR'} {c['output']!r}"
        )
    reward = "none" if result.reward is None else f"{result.reward:.3f} {result.reward_details or ''}".rstrip()
    lines.append(
        f"finish: {result.finish_reason}, reward {reward}" + (f"; error: {result.error}" if result.error else "")
    )
    if original is not None and original.done:
        orig_tail = original.tokens[result.prefix_tokens :]
        same = orig_tail == result.tokens
        lines.append(
            f"original: {original.status} ({original.finish_reason or original.error}), reward "
            f"{original.reward}; its tail after the prefix is {len(orig_tail)} tokens, "
            + (
                "identical"
                if same
                else f"first difference at its token {_first_diff(orig_tail, result.tokens)} (0-based)"
            )
        )
    if decode_text:
        lines.append(f"text: {decode_text(ep.prompt_ids + ep.tokens)!r} + {decode_text(result.tokens)!r}")
    return "\n".join(lines)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
