"""HTTP: the OpenAI-compatible routes over ``core.Gateway``.

The episode is named in the base URL, so a stock client needs only
``base_url=http://host:port/ep/<episode_id>/v1``:

    POST /ep/<episode>/v1/chat/completions   messages, tools, tool_choice, parallel_tool_calls, response_format (a
                                             hint), temperature, top_p, max_tokens, stop, seed, n, logprobs, stream,
                                             return_token_ids (vLLM's: prompt_token_ids, choices[0].token_ids)
    POST /ep/<episode>/v1/completions        prompt (text or token ids), same sampling fields (logprobs: 0 or true)
    POST /ep/<episode>/v1/responses          OpenAI's Responses API (the Agents SDK's default): input items,
                                             instructions, function tools, previous_response_id (apis/responses.py)
    POST /ep/<episode>/v1/messages           Anthropic Messages (apis/messages.py; the anthropic client's
                                             base_url=http://host:port/ep/<episode>), its errors in Anthropic's shape
    GET  /ep/<episode>/v1/models, /v1/models
    GET  /healthz

Any other path gets a JSON 404 naming it (under ``/ep/<episode>/``: with the APIs served, ``SERVED``), and a
served path asked with another method a 405, so an agent written against an API the gateway does not serve
fails at once with a message that says so.

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``
with a 4xx naming the field; a call held longer than ``gateway_timeout`` is
answered 503 with ``x-should-retry: true`` (the SDK retries it, and the retry
waits on the same call: nothing is generated twice).
"""

from __future__ import annotations

import contextlib
import json
import time

import anyio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from services.gateway import stops, threads, toolparse
from services.gateway.apis import messages, responses
from services.gateway.core import Gateway, Prepared
from services.gateway.errors import GatewayError
from services.gateway.limits import MAX_BODY, read_body
from shared.runtime import secrets

# every API under /ep/<episode>: (method, path under the episode's base URL); the one list the routes, the 404's
# message and the docs agree on (/v1/responses and /v1/messages: services/gateway/apis/)
SERVED = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
)
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def unknown_path(method: str, path: str) -> GatewayError:
    """The 404 (or 405: a served path, another method) for a request no route answers, naming what was asked and
    what is served."""
    parts = path.split("/", 3)
    served = ", ".join(f"{m} {p}" for m, p in SERVED)
    if len(parts) > 2 and parts[1] == "ep" and parts[2]:
        rest = "/" + (parts[3] if len(parts) > 3 else "")
        methods = [m for m, p in SERVED if p == rest.rstrip("/")]
        if methods and method not in methods:
            return GatewayError(
                405, f"{method} {path[:200]}: {rest} is served as {' or '.join(methods)}", None, "method_not_allowed"
            )
        return GatewayError(
            404,
            f"{method} {path[:200]}: no such API on this gateway; it serves, under /ep/<episode>: {served}",
            None,
            "unknown_url",
        )
    return GatewayError(
        404,
        f"{method} {path[:200]}: no such path; agents call /ep/<episode>/v1/... ({served}); also GET /v1/models, "
        f"GET /healthz",
        None,
        "unknown_url",
    )


def _error(exc: GatewayError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}},
        status_code=exc.status,
        headers=exc.headers,
    )


def _error_for(path: str, exc: GatewayError) -> JSONResponse:
    """An error in the shape of the API the path is: Anthropic's for Messages, OpenAI's for the rest."""
    return messages.error_response(exc) if messages.is_messages(path) else _error(exc)


def authorized(api_key: str, path: str, headers) -> bool:
    """The gateway's key anywhere; an episode's own key (secrets.episode_key) on that episode's routes. Either
    as ``Authorization: Bearer <key>`` (OpenAI's clients) or as ``x-api-key: <key>`` (Anthropic's)."""
    bearer = headers.get("authorization", "")
    given = [bearer.removeprefix("Bearer ").strip() if bearer.startswith("Bearer ") else ""]
    given.append(headers.get("x-api-key", "").strip())
    parts = path.split("/")
    mine = secrets.episode_key(api_key, parts[2]) if len(parts) > 3 and parts[1] == "ep" else None
    return any(key and (secrets.same(key, api_key) or (mine and secrets.same(key, mine))) for key in given)


class Guard:
    """Every request's checks before its route (the key, the body's declared size), and its errors after, in the
    shape of the API its path is. A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` runs each request
    in a task of its own and streams the answer through a queue, about a millisecond per call on a small box."""

    def __init__(self, app, gw: Gateway, api_key: str):
        self.app, self.gw, self.api_key = app, gw, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        refused = self._refused(scope, path, Headers(scope=scope))
        if refused is not None:
            return await _error_for(path, refused)(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except GatewayError as exc:
            # an answer under way (a stream) cannot become an error any more
            if started:
                raise
            await _error_for(path, exc)(scope, receive, send)
        # never a traceback to the client; the log has it
        except Exception as exc:
            if started:
                raise
            self.gw.log.exception("gateway request failed", path=path)
            error = GatewayError(500, f"internal error: {exc.__class__.__name__}", None, "internal_error")
            await _error_for(path, error)(scope, receive, send)

    def _refused(self, scope, path: str, headers: Headers) -> GatewayError | None:
        if self.api_key and path != "/healthz" and not authorized(self.api_key, path, headers):
            client = scope.get("client")
            self.gw.log.warning("request refused: wrong key", path=path[:200], client=client[0] if client else None)
            return GatewayError(
                401,
                "authorization: missing or wrong API key (a Bearer token or an x-api-key header; an agent "
                "episode's key is good for its own episode only)",
                None,
                "invalid_api_key",
            )
        length = headers.get("content-length") or "0"
        # (a length that is no number: the HTTP parser stops it first)
        if not length.isdigit() or int(length) > MAX_BODY:
            return GatewayError(
                413,
                f"request body: Content-Length {length[:20]}: expected at most {MAX_BODY} bytes",
                None,
                "body_too_large",
            )
        return None


def make_app(gw: Gateway, api_key: str = "") -> Starlette:
    """The gateway's routes on a plain Starlette app (FastAPI's layers, parameter parsing and schema, serve none
    of them: every route reads its request itself), behind ``Guard``."""

    @contextlib.asynccontextmanager
    # a streamed answer is read from its generator in anyio's threads, one per stream: room for many at once
    async def lifespan(_app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = threads.MAX_THREADS
        yield

    def _models() -> dict:
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": "streamrl"} for m in gw.model_names],
        }

    async def models(_request: Request):
        return JSONResponse(_models())

    async def healthz(_request: Request):
        return JSONResponse({"ok": True})

    async def _served(request: Request, chat: bool):
        body = await read_body(request)
        return await threads.run(_answer, request.path_params["episode_id"], body, request.headers, chat)

    async def chat(request: Request):
        return await _served(request, True)

    async def completions(request: Request):
        return await _served(request, False)

    # last: whatever no route above answers
    async def unknown(request: Request):
        raise unknown_path(request.method, request.url.path)

    def _answer(episode_id: str, body, headers, chat: bool):
        prep = (gw.prepare_chat if chat else gw.prepare_completion)(episode_id, body, headers)
        if prep.stream:
            return StreamingResponse(
                _sse(prep, chat), media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        done = [gw.wait_done(prep.episode_id, index, prep.seen) for index in prep.calls]
        # rendered here, off the event loop
        return JSONResponse(_completion(prep, done, chat))

    # a call is prepared, waited on and answered in one pool thread
    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/ep/{episode_id}/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/ep/{episode_id}/v1/chat/completions", chat, methods=["POST"]),
        Route("/ep/{episode_id}/v1/completions", completions, methods=["POST"]),
        responses.route(gw),
        messages.route(gw),
        Route("/{path:path}", unknown, methods=ALL_METHODS),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(Guard, gw=gw, api_key=api_key)

    def _usage(calls) -> dict:
        # n choices share one prompt: counted once, as OpenAI counts it
        prompt, completion = len(calls[0].prompt_ids), sum(len(c.tokens) for c in calls)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _completion(prep: Prepared, calls: list, chat: bool) -> dict:
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{prep.episode_id}-{prep.call}",
            "created": int(time.time()),
            "model": prep.model,
            "usage": _usage(calls),
            "streamrl": {"episode": prep.episode_id, "call": calls[0].index, "calls": [c.index for c in calls]},
        }
        if not chat:
            choices = []
            for j, call in enumerate(calls):
                choice = {
                    "index": j,
                    "text": gw.renderer.text(call),
                    "finish_reason": "stop" if call.reason == "stop" else "length",
                    "logprobs": gw.completion_logprobs(call) if prep.logprobs else None,
                }
                if prep.token_ids:
                    choice.update(prompt_token_ids=call.prompt_ids, token_ids=call.tokens)
                choices.append(choice)
            return {**base, "object": "text_completion", "choices": choices}
        choices = []
        for j, call in enumerate(calls):
            message, reason, problems = gw.answer(call)
            if problems:
                gw.log.warning(
                    "tool call not parsed; answered as text",
                    episode=prep.episode_id,
                    call=call.index,
                    problems=problems,
                )
            choice = {
                "index": j,
                "message": message,
                "finish_reason": reason,
                "logprobs": gw.logprobs(call) if prep.logprobs else None,
            }
            if prep.token_ids:
                choice["token_ids"] = call.tokens
            choices.append(choice)
        # vLLM's names: the prompt's ids at the top, the completion's in the choice
        if prep.token_ids:
            base["prompt_token_ids"] = calls[0].prompt_ids
        return {**base, "object": "chat.completion", "choices": choices}

    def _sse(prep: Prepared, chat: bool):
        """Real streaming: deltas as the tokens land in the episode stream, across aborts and resumes."""
        base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{prep.episode_id}-{prep.call}",
            "created": int(time.time()),
            "model": prep.model,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }

        def event(j: int, delta: dict | None = None, reason=None, text: str | None = None, **extra) -> str:
            choice = {"index": j, "finish_reason": reason}
            if chat:
                choice["delta"] = delta or {}
            else:
                choice["text"] = text or ""
            return f"data: {json.dumps({**base, 'choices': [choice], **extra})}\n\n"

        done = []
        try:
            # choices were all requested at once and generate together; they are streamed one after another
            for j, index in enumerate(prep.calls):
                sent = 0
                if chat:
                    yield event(j, {"role": "assistant", "content": ""})
                for kind, value in gw.follow(prep.episode_id, index, 24 * 3600.0, prep.seen):
                    if kind == "stopping":
                        # the process is stopping: the stream ends unfinished (the client sees a broken stream)
                        return
                    if kind == "wait":
                        # keeps proxies and clients from timing out during a sync
                        yield ": still generating\n\n"
                    elif kind == "tokens":
                        text = gw.tok.decode(value, skip_special_tokens=True)
                        # never a stop string, nor what may yet become one; after the prefill the answer has
                        text = prep.prefill + text[: stops.safe_len(text, prep.stops)]
                        upto = toolparse.safe_prefix_len(text) if chat and prep.parse_tools else len(text)
                        if upto > sent:
                            yield event(j, {"content": text[sent:upto]}, text=text[sent:upto])
                            sent = upto
                    elif kind == "done":
                        call = value
                        done.append(call)
                        text = prep.prefill + gw.renderer.text(call)
                        if chat:
                            message, reason, _ = gw.answer(call)
                            if message.get("tool_calls"):
                                calls = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                                yield event(j, {"tool_calls": calls})
                            elif len(text) > sent:
                                yield event(j, {"content": text[sent:]})
                        else:
                            reason = "stop" if call.reason == "stop" else "length"
                            if len(text) > sent:
                                yield event(j, text=text[sent:])
                        yield event(j, reason=reason)
            if prep.include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(done)})}\n\n"
        except GatewayError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'code': exc.code}})}\n\n"
        yield "data: [DONE]\n\n"

    return app
