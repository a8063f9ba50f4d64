"""Gateway overhead (issue 12): a chat call through the gateway vs the same generation
through the rollout worker's direct path, same tokens, measured side by side in one run.

    python bench/gateway.py [--calls 10] [--tokens 64]

Starts its own EmbeddedRedis, one rollout worker process and one gateway process
(`python -m services.gateway`) on a tiny random-init chat model (the character
tiny Llama + a ChatML template), on CPU, greedy.

- direct: a prompt group (n=1) whose ``prompt_ids`` are the chat prompt's ids is
  added to the prompts stream; timed until the episode's ``finished`` event.
- gateway: a stock ``openai`` client's ``chat.completions.create`` on a fresh
  agent episode (its ``started`` event written beforehand, as the agent runner
  does); timed until the reply is parsed.
Both generate ``--tokens`` tokens (checked: the completion token counts are
printed). Calls alternate (direct, gateway, gateway, direct, ...); reported:
median ms of each, and the median of per-pair ratios gateway / direct.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai  # noqa: E402

from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from shared.protocol.episode.events import decode as decode_event  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402
from tests.support.chat_models import make_chat_model  # noqa: E402
from tests.support.gateway_stack import env_for, free_port, start_agent_episode, wait_alive, wait_http  # noqa: E402
from tests.support.procs import spawn, stop  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 12+30? Think step by step."}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10)
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

        def direct(i: int) -> tuple[float, int]:
            gid = f"d{i}"
            key = keys.episode(f"{gid}-0")
            t0 = time.perf_counter()
            enqueue(
                client,
                keys,
                [PromptGroup(gid, 1, prompt_ids=prompt_ids, sampling={"max_tokens": args.tokens, "temperature": 0.0})],
            )
            cursor = "0-0"
            while True:
                reply = client.xread({key: cursor}, block=5000)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        cursor = entry_id
                        if decode_event(entry_id, fields).kind == "finished":
                            ms = (time.perf_counter() - t0) * 1000
                            from shared.protocol.episode.fold import fold

                            return ms, len(fold(client.xrange(key)).tokens)

        def gateway(i: int) -> tuple[float, int]:
            eid = f"g{i}-0"
            start_agent_episode(client, keys, eid)
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/ep/{eid}/v1", api_key="x")
            t0 = time.perf_counter()
            r = api.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=args.tokens, temperature=0)
            return (time.perf_counter() - t0) * 1000, r.usage.completion_tokens

        # warm both paths (first prefill, imports, connections)
        direct(-1), gateway(-1)
        d_ms, g_ms, ratios, d_tok, g_tok = [], [], [], [], []
        for i in range(args.calls):
            order = (direct, gateway) if i % 2 == 0 else (gateway, direct)
            res = {f.__name__: f(i) for f in order}
            d_ms.append(res["direct"][0]), g_ms.append(res["gateway"][0])
            d_tok.append(res["direct"][1]), g_tok.append(res["gateway"][1])
            ratios.append(res["gateway"][0] / res["direct"][0])
        print(f"gateway overhead, {args.calls} calls each, {args.tokens} tokens per call, tiny model, CPU")
        print(f"  tokens per call: direct {sorted(set(d_tok))}, gateway {sorted(set(g_tok))}")
        print(f"  direct path  median {statistics.median(d_ms):8.1f} ms")
        print(f"  gateway      median {statistics.median(g_ms):8.1f} ms")
        print(
            f"  ratio gateway/direct (median of pairs) {statistics.median(ratios):.3f}  "
            f"(+{statistics.median(g_ms) - statistics.median(d_ms):.1f} ms)"
        )
        from bench.record import record

        record(
            "gateway",
            [
                {
                    "what": f"a {args.tokens}-token call through the gateway (stock openai client) vs the same prompt "
                    f"through the prompts stream, tiny model",
                    "value": f"{statistics.median(ratios):.3f}x the time, median of {args.calls} pairs "
                    f"(+{statistics.median(g_ms) - statistics.median(d_ms):.1f} ms on "
                    f"{statistics.median(d_ms):.0f} ms)",
                }
            ],
            ["services/gateway", "services/rollout", "shared", "bench/gateway.py"],
        )
    finally:
        for p in procs:
            stop(p)
        server.stop()


if __name__ == "__main__":
    main()
