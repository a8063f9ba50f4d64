"""The rq job that runs one agent episode: ``run_episode(spec)``.

The job writes the episode's ``started`` event (unless its stream already has
it: a re-run), calls the user's ``agent(client, task)`` with a stock
``openai.OpenAI`` client bound to the episode (``base_url=<gateway>/ep/<id>/v1``),
writes ``finished`` with the reward it returns (or ``failed``), and publishes
the group to ``samples`` exactly once when the last of its episodes ends.

Durable: when the process running an agent dies, another agents worker runs
the job again (``agents_worker`` reaps jobs whose worker's heartbeat lapsed).
Every call the agent makes again is matched to the call already in the stream
by its digest and its place among the run's identical asks (``asks.py``) and
answered from it, so no completed call is generated twice; a call still in
flight is waited on.

The same holds when the gateway is what broke: an agent that raises a connection
error (any SDK's: the gateway restarted under a streamed call, which no client
retries, or a framework's client gave up after its own few retries) or a 5xx
from the gateway is run again in the same job, once the gateway answers again,
up to ``GATEWAY_RERUNS`` times within the episode's timeout. Its completed calls
are answered from the log and a call cut mid-stream is answered whole from its
stream. Only when the gateway stays away is the episode failed, with ``where``
``gateway``: an infrastructure failure, which ``streamrl check`` counts apart
from the agent's own errors.

Cut short, not failed: a call broken by the run's end (this worker is stopping:
``STOPPING``, set by the agents worker's SIGTERM; or the gateway said
``gateway_stopping`` and did not come back) is no error of the agent. The
episode gets no terminal event and stays in ``agents:running``: a reaper runs
it again if the run goes on, as it does an episode the worker's grace cut.
"""

from __future__ import annotations

import json
import threading
import time

from services.gateway.asks import Asks
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog, Fenced
from shared.protocol.keys import Keys
from shared.protocol.streams import metrics
from shared.runtime import faults, logs, secrets, specs

# set by the agents worker process: who runs the job (for the reaper)
WORKER_ID = "agents-inline"
# set by the agents worker process: the run's Redis (None: the job's rq connection is that server)
CLIENT = None
# set by the agents worker process from its config: (gateway URL, gateway key); never from a job
GATEWAY = ("", "")
# set by the agents worker when it is told to stop (the run ends): a broken call is then the run's end, not a failure
STOPPING = threading.Event()

_PUBLISH = """
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], 604800)
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  if redis.call('SET', KEYS[2], ARGV[2], 'NX', 'EX', 604800) then
    redis.call('XADD', KEYS[3], '*', 'group_id', ARGV[2], 'episodes', ARGV[4], 'worker', ARGV[5], 'n', ARGV[3])
    return 1
  end
end
return 0
"""


# runs of one agent episode after the first, each after the gateway broke under it
GATEWAY_RERUNS = 20
# the class names, across the SDKs agents use, of "the connection to the server broke": builtins
# (ConnectionError, http.client's IncompleteRead), httpx (TransportError), openai and anthropic
# (APIConnectionError), requests (ConnectionError, ChunkedEncodingError), urllib3 (ProtocolError), aiohttp
# (ClientConnectionError, ServerDisconnectedError)
_CONNECTION_ERRORS = {
    "ConnectionError",
    "IncompleteRead",
    "TransportError",
    "APIConnectionError",
    "ChunkedEncodingError",
    "ProtocolError",
    "ClientConnectionError",
    "ServerDisconnectedError",
}


def lost_gateway(exc: BaseException) -> bool:
    """Whether an agent's exception says its connection to the gateway broke, or the gateway answered 5xx: the
    exception or one it was raised from (frameworks wrap the SDK's) is a connection error of any SDK, or carries
    an HTTP status of 500 or more."""
    for e in _causes(exc):
        if any(c.__name__ in _CONNECTION_ERRORS for c in type(e).__mro__):
            return True
        status = getattr(e, "status_code", None) or getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int) and status >= 500:
            return True
        # an error event in a stream that had begun (status 200): Anthropic's overloaded or api error, which the
        # gateway sends when it stops under a streamed Messages call
        body = getattr(e, "body", None)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("type") in ("overloaded_error", "api_error"):
            return True
    return False


def gateway_stopping(exc: BaseException) -> bool:
    """Whether the gateway's last answer in the exception's chain was its 503 ``gateway_stopping`` (the run ends, or
    it restarts)."""
    for e in _causes(exc):
        response = getattr(e, "response", None)
        if getattr(response, "status_code", None) == 503:
            try:
                if "gateway_stopping" in response.text:
                    return True
            # a streamed response not read: no body to tell
            except Exception:
                pass
    return False


def _causes(exc: BaseException | None):
    """The exception, those it was raised from or during (frameworks wrap the SDK's), and the members of exception
    groups (anyio's task groups wrap them so), each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__ or e.__context__, *getattr(e, "exceptions", ())]


def wait_for_gateway(url: str, deadline: float) -> bool:
    """Poll the gateway's health route until it answers (True) or the deadline (a monotonic time) passes. An
    HTTP server, not Redis: nothing to block on, so a short poll with a growing pause."""
    import httpx

    pause = 0.1
    # a stopping worker waits for nothing: its episode is cut short
    while time.monotonic() < deadline and not STOPPING.is_set():
        try:
            if httpx.get(f"{url}/healthz", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 2.0)
    return False


def load_agent(spec: str):
    return specs.load(spec, "agent")


def normalise(out) -> tuple[float, dict]:
    """What an agent returns -> (reward, details): a number, or a dict with 'reward' (and 'details')."""
    details: dict = {}
    if isinstance(out, dict):
        details = dict(out.get("details") or {})
        out = out.get("reward")
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"agent returned {type(out).__name__}, expected a number or a dict with a numeric 'reward'")
    return float(out), details


def _append_last(log: EpisodeLog, episode_id: str, kind: str, data: dict, policy: int = 0, tries: int = 20) -> bool:
    """Append one event after whatever the stream holds (other writers may be appending calls)."""
    for _ in range(tries):
        ep = fold(log.read(episode_id))
        if ep.done:
            return False
        log.open(episode_id, ep.last_seq + 1)
        log.append(episode_id, kind, data, policy)
        try:
            log.flush_or_raise([episode_id])
            return True
        except Fenced:
            continue
    raise RuntimeError(f"episode {episode_id}: could not append {kind!r} after {tries} tries")


def _record_metrics(client, keys: Keys, episode_id: str) -> None:
    """One 'agent' metrics record per ended episode: calls, training rows, forks (linear chains vs rewritten
    histories), aborted and resumed calls."""
    ep = fold(client.xrange(keys.episode(episode_id)))
    calls = list(ep.calls.values())
    metrics.record(
        client,
        keys,
        "agent",
        {
            "episode": episode_id,
            "time": time.time(),
            "status": ep.status,
            "reward": ep.reward,
            "calls": len(calls),
            "rows": len(ep.rows) if calls else 0,
            "forks": sum(c.extends < 0 and c.index > 0 for c in calls),
            "linear": int(bool(calls) and not ep.branches),
            "aborted_calls": sum(bool(c.aborts) for c in calls),
            "generated": ep.num_generated,
            "group": ep.group_id,
            # why it failed, the episode's own id taken out (the same cause reads the same: the driver counts them)
            **({"error": (ep.error or "")[:300].replace(episode_id, "<episode>")} if ep.status == "failed" else {}),
        },
    )


_HTTP: list = []
_HTTP_LOCK = threading.Lock()


def _http_client():
    """The process's one HTTP connection pool for its agents' clients (thread-safe, kept alive to the gateway).
    A client of its own costs an episode ~50 ms of CPU (an SSL context and its CA bundle, loaded though the
    gateway speaks plain HTTP): more than the episode's two LLM calls cost the rest of the pipeline."""
    import openai

    with _HTTP_LOCK:
        if not _HTTP:
            _HTTP.append(openai.DefaultHttpxClient())
        return _HTTP[0]


def _run_agent(spec: dict, events: EpisodeLog, log) -> dict:
    """Run the user's agent to its end (re-running it while the gateway is what broke) and append the episode's
    terminal event. Returns what the job reports: reward or error, and the gateway reruns."""
    import openai

    eid = spec["episode_id"]
    t0 = time.monotonic()
    deadline = t0 + float(spec.get("timeout", 600.0))
    url, key = GATEWAY if GATEWAY[0] else (spec["gateway_url"], "")
    rerun = 0
    asks = Asks(events.client, events.keys)
    while True:
        # a run of the agent: its k-th ask of a request is that request's k-th call (the calls a run before this
        # one made are answered from the log; services/gateway/asks.py)
        asks.new_run(eid)
        # the agent holds its episode's own key, never the gateway's: it can call into this episode only
        oai = openai.OpenAI(
            base_url=f"{url}/ep/{eid}/v1",
            api_key=secrets.episode_key(key, eid) if key else "streamrl",
            max_retries=100,
            timeout=spec.get("timeout", 600.0),
            http_client=_http_client(),
        )
        try:
            reward, details = normalise(load_agent(spec["agent"])(oai, dict(spec["task"])))
        # a user's agent can raise anything: an error on the episode, not a lost group
        except Exception as exc:
            error = f"agent {spec['agent']} raised {exc.__class__.__name__}: {exc}"
            gateway = lost_gateway(exc)
            if gateway and not STOPPING.is_set() and rerun < GATEWAY_RERUNS and wait_for_gateway(url, deadline):
                rerun += 1
                log.warning("agent lost the gateway; running it again, its calls answered from the log", error=error)
                continue
            if gateway and (STOPPING.is_set() or gateway_stopping(exc)):
                log.warning("agent episode cut short by the run's end; left for a reaper", error=error[:300])
                return {"cut_short": error, "gateway_reruns": rerun}
            log.warning("agent episode failed", error=error, gateway=gateway)
            where = "gateway" if gateway else "agent"
            if _append_last(events, eid, "failed", {"error": error[:2000], "where": where}):
                events.client.hincrby(events.keys.agents_ended, "failed", 1)
            return {"error": error, "gateway_reruns": rerun}
        if _append_last(events, eid, "finished", {"reason": "stop", "reward": reward, "details": details}):
            events.client.hincrby(events.keys.agents_ended, "finished", 1)
        log.info("agent episode finished", reward=reward, seconds=round(time.monotonic() - t0, 3), reruns=rerun)
        return {"reward": reward, "gateway_reruns": rerun}


def run_episode(spec: dict) -> dict:
    from rq import get_current_job

    job = get_current_job()
    client = CLIENT or job.connection
    keys = Keys(spec["run"])
    eid = spec["episode_id"]
    log = logs.get("agents", episode=eid, worker=WORKER_ID)
    # a kill here: a reaper finds the job in rq's started registry
    faults.crash_point("agents", "job_started")
    # the job's rq id too: a reaper that runs the episode again retires this job (rq would later call it failed)
    client.hset(
        keys.agents_running, eid, json.dumps({"worker": WORKER_ID, "spec": spec, "job": job.id if job else None})
    )
    events = EpisodeLog(client, keys, WORKER_ID)
    if not events.read(eid):
        events.open(eid, 0)
        events.append(
            eid,
            "started",
            {
                "episode_id": eid,
                "group_id": spec["group_id"],
                "index": spec["index"],
                "prompt_ids": [],
                "sampling": spec.get("sampling", {}),
                "task": spec["task"],
                "agent": spec["agent"],
            },
            0,
        )
        try:
            events.flush_or_raise([eid])
        except Fenced:
            # another run of this job started it first
            pass
    ep = fold(events.read(eid))
    result = {"episode_id": eid, "rerun": bool(ep.calls) or ep.done}
    if not ep.done:
        result.update(_run_agent(spec, events, log))
    if "cut_short" in result:
        # no end, no publish: it stays in agents:running for a reaper
        return result
    _record_metrics(client, keys, eid)
    published = client.eval(
        _PUBLISH,
        3,
        keys.agents_done(spec["group_id"]),
        keys.sampled(spec["group_id"]),
        keys.samples,
        eid,
        spec["group_id"],
        len(spec["episodes"]),
        ",".join(spec["episodes"]),
        WORKER_ID,
    )
    client.hdel(keys.agents_running, eid)
    result["published"] = bool(published)
    return result
