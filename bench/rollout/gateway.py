"""Gateway overhead: a chat call through the gateway vs the same generation
through the rollout worker's direct path, same tokens, measured side by side in one run.

    python bench/rollout/gateway.py [--calls 20] [--tokens 64]

Starts its own EmbeddedRedis, one rollout worker process and one gateway process
(`python -m services.gateway`) on a tiny random-init chat model (the character
tiny Llama + a ChatML template), on CPU, greedy.

- direct: a prompt group (n=1) whose ``prompt_ids`` are the chat prompt's ids is
  added to the prompts stream; timed until the episode's ``finished`` event.
- gateway: a stock ``openai`` client's ``chat.completions.create`` on a fresh
  agent episode (its ``started`` event written beforehand, as the agent runner
  does), its client on one connection pool as the agent runner's; timed until the reply is parsed.
Both generate ``--tokens`` tokens (checked: the bench stops when they differ). Calls alternate (direct,
gateway, gateway, direct, ...); reported: median ms of each, each pair's difference gateway - direct and their
median (the gateway's fixed cost per call), the median of per-pair ratios, and where the time went by stage, read
from the Redis entry ids (1 ms resolution): before the request's stream entry (prompts / calls), from it to the
worker's first event of the episode (``started`` / ``call``), from there to the end (``finished`` /
``call_done``), and from the end to the client's answer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import openai  # noqa: E402

from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from shared.protocol.episode.events import decode as decode_event  # noqa: E402
from shared.protocol.episode.fold import fold  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402
from tests.support.chat_models import make_chat_model  # noqa: E402
from tests.support.gateway_stack import env_for, free_port, start_agent_episode, wait_alive, wait_http  # noqa: E402
from tests.support.procs import spawn, stop  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 12+30? Think step by step."}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = make_chat_model(tmp / "model", max_len=512, seed=3)
    server = EmbeddedRedis(tmp / "redis").start()
    client = connect(server.url)
    keys = Keys("benchgw")
    port = free_port()
    env = env_for(server.url, keys, model, temperature=0, gateway_port=port, max_tokens=args.tokens)
    procs = [spawn("services.rollout", "--worker-id", "bw", env=env), spawn("services.gateway", env=env)]
    try:
        wait_alive(client, keys, "rollout", "bw")
        wait_http(port)
        from transformers import AutoTokenizer

        from services.gateway.chat import Renderer

        tok = AutoTokenizer.from_pretrained(model)
        renderer = Renderer(tok)
        prompt_ids = renderer.full(MESSAGES, None)

        def stamp(entry_id) -> float:
            # a stream entry id's milliseconds: when Redis took the entry (the same clock as time.time here)
            return float((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])

        def direct(i: int) -> dict:
            gid = f"d{i}"
            key = keys.episode(f"{gid}-0")
            wall, t0 = time.time() * 1000, time.perf_counter()
            entry = enqueue(
                client,
                keys,
                [PromptGroup(gid, 1, prompt_ids=prompt_ids, sampling={"max_tokens": args.tokens, "temperature": 0.0})],
            )
            cursor, first = "0-0", None
            while True:
                reply = client.xread({key: cursor}, block=5000)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        cursor = entry_id
                        first = first or stamp(entry_id)
                        if decode_event(entry_id, fields).kind == "finished":
                            ms = (time.perf_counter() - t0) * 1000
                            end = wall + ms
                            sent = stamp(entry[0])
                            return {
                                "ms": ms,
                                "tokens": len(fold(client.xrange(key)).tokens),
                                "stages": (sent - wall, first - sent, stamp(entry_id) - first, end - stamp(entry_id)),
                            }

        def gateway(i: int) -> dict:
            eid = f"g{i}-0"
            start_agent_episode(client, keys, eid)
            started = stamp(client.xrange(keys.episode(eid))[-1][0])
            wall, t0 = time.time() * 1000, time.perf_counter()
            r = api(eid).chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=args.tokens, temperature=0
            )
            ms = (time.perf_counter() - t0) * 1000
            end = wall + ms
            events = [(stamp(e), decode_event(e, f)) for e, f in client.xrange(keys.episode(eid))]
            opened = next(t for t, ev in events if ev.kind == "call" and t >= started)
            done = next(t for t, ev in events if ev.kind == "call_done")
            sent = stamp(client.xrevrange(keys.calls, count=1)[0][0])
            return {
                "ms": ms,
                "tokens": r.usage.completion_tokens,
                "stages": (sent - wall, opened - sent, done - opened, end - done),
            }

        # one connection pool for every episode's client, as the agent runner keeps (services/gateway/runner.py)
        pool = openai.DefaultHttpxClient()

        def api(eid: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/ep/{eid}/v1", api_key="x", http_client=pool)

        # warm both paths (first prefill, imports, connections)
        for w in range(3):
            direct(-1 - w), gateway(-1 - w)
        res: dict[str, list[dict]] = {"direct": [], "gateway": []}
        for i in range(args.calls):
            order = (direct, gateway) if i % 2 == 0 else (gateway, direct)
            for f in order:
                res[f.__name__].append(f(i))
        d_ms = [r["ms"] for r in res["direct"]]
        g_ms = [r["ms"] for r in res["gateway"]]
        diffs = [g - d for g, d in zip(g_ms, d_ms)]
        ratios = [g / d for g, d in zip(g_ms, d_ms)]
        d_tok = sorted({r["tokens"] for r in res["direct"]})
        g_tok = sorted({r["tokens"] for r in res["gateway"]})
        if d_tok != [args.tokens] or g_tok != [args.tokens]:
            raise SystemExit(f"the paths generated different token counts: direct {d_tok}, gateway {g_tok}")
        extra = statistics.median(diffs)
        print(f"gateway overhead, {args.calls} pairs, {args.tokens} tokens per call, tiny model, CPU")
        print(f"  tokens per call: direct {d_tok}, gateway {g_tok}")
        print(f"  direct path  median {statistics.median(d_ms):8.1f} ms")
        print(f"  gateway      median {statistics.median(g_ms):8.1f} ms")
        print(f"  per pair, gateway - direct (ms): {' '.join(f'{x:+.1f}' for x in diffs)}")
        print(f"  median of pairs: {extra:+.2f} ms, ratio {statistics.median(ratios):.3f}")
        names = ("to the stream", "to the worker's open", "open to done", "done to the client")
        print("  stages, median ms (Redis entry ids: 1 ms resolution)    direct   gateway   difference")
        for k, name in enumerate(names):
            d = statistics.median(r["stages"][k] for r in res["direct"])
            g = statistics.median(r["stages"][k] for r in res["gateway"])
            print(f"    {name:<52} {d:7.1f}   {g:7.1f}   {g - d:+7.1f}")
        from bench.harness.record import record

        record(
            "gateway",
            [
                {
                    "what": f"a {args.tokens}-token call through the gateway (stock openai client) vs the same prompt "
                    f"through the prompts stream, tiny model",
                    "value": f"{extra:+.1f} ms per call (median of {args.calls} pairs), ratio "
                    f"{statistics.median(ratios):.3f} (calls of {statistics.median(d_ms):.0f} ms)",
                }
            ],
            ["services/gateway", "services/rollout", "shared", "bench/rollout/gateway.py"],
        )
    finally:
        for p in procs:
            stop(p)
        server.stop()


if __name__ == "__main__":
    main()
