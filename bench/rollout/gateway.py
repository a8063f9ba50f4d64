"""Gateway overhead: a chat call through the gateway vs the same generation
through the rollout worker's direct path, same tokens, measured side by side in one run.

    python bench/rollout/gateway.py [--calls 20] [--tokens 64]

Starts its own EmbeddedRedis, one rollout worker process and one gateway process
(`python -m services.gateway`) on a tiny random-init chat model (the character
tiny Llama + a ChatML template), on CPU, greedy.

- direct: a prompt group (n=1) whose ``prompt_ids`` are the chat prompt's ids is
  added to the prompts stream; timed until the episode's ``finished`` event.
- gateway: a stock ``openai`` client's ``chat.completions.create`` on a fresh agent episode (its ``started``
  event written beforehand, as the agent runner does), every episode's client on one connection pool as the agent
  runner's; timed until the reply is parsed.
- http: the same request as a bare HTTP POST on that pool (httpx, the JSON answer parsed): the gateway's cost
  without the SDK's own (building the request, parsing the answer into its models).
All generate ``--tokens`` tokens (checked: the bench stops when they differ). Each pair (here a triple) runs
its calls in turn, in an order that cycles through every permutation. Reported: median ms of each path, each
pair's difference gateway - direct and its median; and the same less each call's generation (from the worker's
first event of the call, ``started`` / ``call``, to its end, ``finished`` / ``call_done``, read from the Redis
entry ids, 1 ms resolution): the fixed cost per call, the headline, as the generation's own scatter on a shared
box (tens of ms per call) would drown it. Also by stage: before the request's stream entry (prompts / calls), from
it to the worker's first event, the generation, and from its end to the client's answer.

For scale, the same two clients also call a null server (``--null-server``: a Starlette route on uvicorn, as the
gateway is served, answering a fixed chat completion at once): the round trip any OpenAI-compatible server costs
these clients, which the direct path does not have. Each round of calls times it too, and the gateway's own cost is
each round's fixed cost less the null server's round trip with the same client (median over rounds): what an agent
pays for the gateway over any other OpenAI-compatible server. Both figures are recorded.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
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


def null_server(port: int, tokens: int) -> None:
    """Serve a fixed chat completion of ``tokens`` tokens at once, on the gateway's stack (Starlette on uvicorn)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    answer = {
        "id": "chatcmpl-null",
        "object": "chat.completion",
        "created": 0,
        "model": "policy",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * tokens}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": tokens, "total_tokens": 30 + tokens},
    }

    async def chat(request):
        await request.body()
        return JSONResponse(answer)

    async def healthz(_request):
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])]
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--null-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.null_server:
        return null_server(args.null_server, args.tokens)
    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    model = make_chat_model(tmp / "model", max_len=512, seed=3)
    server = EmbeddedRedis(tmp / "redis").start()
    client = connect(server.url)
    keys = Keys("benchgw")
    port = free_port()
    env = env_for(server.url, keys, model, temperature=0, gateway_port=port, max_tokens=args.tokens)
    procs = [spawn("services.rollout", "--worker-id", "bw", env=env), spawn("services.gateway", env=env)]
    null_port = free_port()
    procs.append(
        subprocess.Popen(
            [sys.executable, __file__, "--null-server", str(null_port), "--tokens", str(args.tokens)],
            start_new_session=True,
        )
    )
    try:
        wait_alive(client, keys, "rollout", "bw")
        wait_http(port)
        wait_http(null_port)
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

        # one connection pool for every episode's client, as the agent runner keeps (services/gateway/runner.py)
        pool = openai.DefaultHttpxClient()
        body = {"model": "policy", "messages": MESSAGES, "max_tokens": args.tokens, "temperature": 0}

        def through(i: int, sdk: bool) -> dict:
            eid = f"{'g' if sdk else 'h'}{i}-0"
            start_agent_episode(client, keys, eid)
            started = stamp(client.xrange(keys.episode(eid))[-1][0])
            url = f"http://127.0.0.1:{port}/ep/{eid}/v1"
            api = openai.OpenAI(base_url=url, api_key="x", http_client=pool)
            wall, t0 = time.time() * 1000, time.perf_counter()
            if sdk:
                tokens = api.chat.completions.create(**body).usage.completion_tokens
            else:
                tokens = pool.post(f"{url}/chat/completions", json=body).json()["usage"]["completion_tokens"]
            ms = (time.perf_counter() - t0) * 1000
            end = wall + ms
            events = [(stamp(e), decode_event(e, f)) for e, f in client.xrange(keys.episode(eid))]
            opened = next(t for t, ev in events if ev.kind == "call" and t >= started)
            done = next(t for t, ev in events if ev.kind == "call_done")
            sent = stamp(client.xrevrange(keys.calls, count=1)[0][0])
            return {"ms": ms, "tokens": tokens, "stages": (sent - wall, opened - sent, done - opened, end - done)}

        def gateway(i: int) -> dict:
            return through(i, True)

        def http(i: int) -> dict:
            return through(i, False)

        null_api = openai.OpenAI(base_url=f"http://127.0.0.1:{null_port}/v1", api_key="x", http_client=pool)

        def null(i: int) -> dict:
            t0 = time.perf_counter()
            tokens = null_api.chat.completions.create(**body).usage.completion_tokens
            return {"ms": (time.perf_counter() - t0) * 1000, "tokens": tokens, "stages": (0.0, 0.0, 0.0, 0.0)}

        def null_http(i: int) -> dict:
            t0 = time.perf_counter()
            tokens = pool.post(f"http://127.0.0.1:{null_port}/v1/chat/completions", json=body).json()["usage"]
            return {"ms": (time.perf_counter() - t0) * 1000, "tokens": tokens["completion_tokens"], "stages": (0,) * 4}

        paths = (direct, gateway, http)
        references = (null, null_http)
        # warm every path (first prefill, imports, connections)
        for w in range(3):
            for f in paths + references:
                f(-1 - w)
        res: dict[str, list[dict]] = {f.__name__: [] for f in paths}
        ref: dict[str, list[float]] = {f.__name__: [] for f in references}
        orders = list(itertools.permutations(paths))
        for i in range(args.calls):
            for f in orders[i % len(orders)]:
                res[f.__name__].append(f(i))
            for f in references:
                ref[f.__name__].append(f(i)["ms"])
        ms = {name: [r["ms"] for r in rs] for name, rs in res.items()}
        # a call's fixed cost: its time less its generation (the worker's first event of it to its last)
        fixed = {name: [r["ms"] - r["stages"][2] for r in rs] for name, rs in res.items()}
        toks = {name: sorted({r["tokens"] for r in rs}) for name, rs in res.items()}
        if any(t != [args.tokens] for t in toks.values()):
            raise SystemExit(f"the paths generated different token counts: {toks}")

        def pairs(name: str, of: dict) -> list[float]:
            return [g - d for g, d in zip(of[name], of["direct"])]

        extra = statistics.median(pairs("gateway", fixed))
        bare = statistics.median(pairs("http", fixed))
        whole = statistics.median(pairs("gateway", ms))
        ratio = statistics.median(g / d for g, d in zip(ms["gateway"], ms["direct"]))
        print(f"gateway overhead, {args.calls} interleaved pairs, {args.tokens} tokens per call, tiny model, CPU")
        print(f"  tokens per call: {toks}")
        for name in ms:
            whole_ms, fixed_ms = statistics.median(ms[name]), statistics.median(fixed[name])
            print(f"  {name:<8} median {whole_ms:8.1f} ms, fixed cost {fixed_ms:6.2f} ms")
        print(f"  per pair, gateway - direct (ms): {' '.join(f'{x:+.1f}' for x in pairs('gateway', ms))}")
        less = " ".join(f"{x:+.1f}" for x in pairs("gateway", fixed))
        print(f"  per pair, the same less each call's generation: {less}")
        print(f"  median of pairs, whole calls: {whole:+.2f} ms (ratio {ratio:.3f})")
        print(
            f"  median of pairs, fixed cost (generation excluded): {extra:+.2f} ms with the openai client, "
            f"{bare:+.2f} ms with a bare HTTP POST"
        )
        null_sdk, null_bare = statistics.median(ref["null"]), statistics.median(ref["null_http"])
        own = statistics.median(g - n for g, n in zip(pairs("gateway", fixed), ref["null"]))
        own_bare = statistics.median(g - n for g, n in zip(pairs("http", fixed), ref["null_http"]))
        print(
            f"  a null server's round trip (no generation, no Redis): {null_sdk:.2f} ms with the openai client, "
            f"{null_bare:.2f} ms with a bare HTTP POST"
        )
        print(
            f"  the gateway's own cost (each round's fixed cost less its null round trip): {own:+.2f} ms with the "
            f"openai client, {own_bare:+.2f} ms bare"
        )
        names = ("to the stream", "to the worker's open", "open to done", "done to the client")
        print("  stages, median ms (Redis entry ids: 1 ms resolution)        direct   gateway  bare http")
        for k, name in enumerate(names):
            row = [statistics.median(r["stages"][k] for r in res[p]) for p in ("direct", "gateway", "http")]
            print(f"    {name:<52} {row[0]:7.1f}   {row[1]:7.1f}   {row[2]:7.1f}")
        from bench.harness.record import record

        record(
            "gateway",
            [
                {
                    "what": f"a {args.tokens}-token call through the gateway (stock openai client) vs the same prompt "
                    f"through the prompts stream, tiny model",
                    "value": f"{extra:+.1f} ms fixed cost per call (median of {args.calls} pairs, generation "
                    f"excluded; {bare:+.1f} ms without the SDK), of which a null server's round trip is "
                    f"{null_sdk:.1f} ms ({null_bare:.1f} ms bare): the gateway's own {own:+.1f} ms "
                    f"({own_bare:+.1f} ms bare); whole calls {whole:+.1f} ms, ratio {ratio:.3f} "
                    f"(calls of {statistics.median(ms['direct']):.0f} ms)",
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
