"""`streamrl replay`'s decoding and its ``--continue``: a text episode's continuation generated in-process, an
agent episode's agent run again on a scratch stack; neither writes to the run's Redis."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class ReplayError(ValueError):
    """A replay that cannot go on: one line for the person who asked for it."""


def model_dir(cfg) -> str:
    from shared.runtime.models import resolve_model

    return resolve_model(cfg.model_dir)


def decoder(cfg):
    path = cfg.tokenizer or model_dir(cfg)
    if not path or not Path(path, "tokenizer.json").exists():
        if cfg.tokenizer:
            raise ReplayError(f"tokenizer {cfg.tokenizer!r}: no tokenizer.json there")
        return None
    # the fast tokenizer's own library: what transformers' decode calls, without importing transformers (seconds of CPU
    # for a command that only reads)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path, "tokenizer.json")))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def replay_version(cfg, args, log, version: int) -> tuple[str | None, str, str]:
    """(weights path or None for model_dir, sha256, label) of the version a continuation runs with."""
    from services.rollout.episodes import continuation as cont

    if args.weights:
        if args.version is None:
            raise cont.ContinuationError("--weights PATH needs --version V: the version to tag its tokens with")
        if not Path(args.weights).exists():
            raise cont.ContinuationError(f"--weights {args.weights}: no such file or folder")
        return args.weights, "", f"{args.weights} (tagged v{version})"
    from shared.protocol.streams import versions

    path, sha = cont.resolve_version(versions.read_all(log.client, log.keys, cfg.run_path), version, cfg.model_dir)
    return path, sha, f"v{version} ({path or cfg.model_dir})"


def continue_agent(cfg, args, log, entries, ep, decode_text) -> int:
    """`replay --continue` of an agent episode: the agent runs again against a scratch stack (writes nothing)."""
    from services.ops.replay import agent as agent_replay
    from services.rollout.episodes import continuation as cont

    if args.from_seq is not None:
        raise ReplayError(f"--from-seq: episode {args.episode} is an agent episode; use --from-call K")
    try:
        agent_replay.from_call_of(ep, args.from_call)
        version = (
            args.version
            if args.version is not None
            else max((v for c in ep.calls.values() for v in c.versions), default=0)
        )
        path, sha, _ = replay_version(cfg, args, log, version)
        result = agent_replay.continue_agent(
            cfg,
            entries,
            args.from_call,
            version,
            (path, sha),
            model_dir(cfg),
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (cont.ContinuationError, agent_replay.AgentReplayError) as exc:
        raise ReplayError(f"episode {args.episode}: {exc}") from None
    if args.json:
        print(
            json.dumps(
                {
                    "from_call": result.from_call,
                    "version": result.version,
                    "reward": result.reward,
                    "original_reward": ep.reward,
                    "error": result.error,
                    "generated_by_replay": sorted(
                        {e.data.get("call") for e in result.rerun.events if e.kind == "tokens" and e.worker == "replay"}
                    ),
                    "calls": {
                        i: {"tokens": c.tokens, "versions": sorted(set(c.versions)), "extends": c.extends}
                        for i, c in result.rerun.calls.items()
                    },
                }
            )
        )
    else:
        print(agent_replay.format_replay(result, decode_text))
    return 0


def continue_text(cfg, args, log, entries, ep, decode_text) -> int:
    """`replay --continue`: generate the episode's continuation in-process; writes nothing to Redis."""
    from services.rollout.engine import EngineError, make_engine
    from services.rollout.episodes import continuation as cont
    from services.rollout.jobs import rewards

    try:
        prefix = cont.prefix_at(entries, args.from_seq)
        version = prefix.policy if args.version is None else args.version
        path, sha, label = replay_version(cfg, args, log, version)
        reward_fn = rewards.load(cfg.reward_fn)
        try:
            engine = make_engine(
                cfg.engine,
                model_dir(cfg),
                device=cfg.device_of("rollout"),
                max_batch_size=1,
                vllm_args=cfg.vllm_args,
                routing_replay=cfg.routing_replay,
            )
        except EngineError as exc:
            raise cont.ContinuationError(f"model_dir {cfg.model_dir}: {exc}") from None
        cont.load_version(engine, version, path, sha)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(cfg.tokenizer or model_dir(cfg))
        result = cont.continue_from(prefix, engine, tok, reward_fn, cfg.tools, cfg.max_tool_calls, cfg.tool_timeout)
    except (cont.ContinuationError, ValueError) as exc:
        raise ReplayError(f"episode {args.episode}: {exc}") from None
    if args.json:
        print(json.dumps(cont.as_dict(prefix, result, decode_text), default=str))
    else:
        print(cont.format_result(prefix, result, label, ep, decode_text))
    return 0
