"""Anthropic Messages (``POST /ep/<episode>/v1/messages``) over the gateway's chat calls.

The stock ``anthropic`` client works unchanged with ``base_url=http://host:port/ep/<episode>`` (it appends
``/v1/messages``) and the episode's key as ``api_key`` (sent as ``x-api-key``). The request is read and rendered as
chat messages by ``messages_request``; the call is made or found by ``Gateway.chat_calls`` (exact ids, retries,
crash recovery: the chat path's); the answer is built from ``Gateway.answer(call)``: a text block and/or
``tool_use`` blocks (ids ``toolu_<call>_<k>``: a retry gets the same), whole or streamed as Anthropic's SSE events.
Errors come out in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, the message naming the
field; a 503 keeps ``x-should-retry: true`` so the SDK retries (the retry waits on the same call).
"""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from services.gateway import stops, threads, toolparse
from services.gateway.apis import messages_request
from services.gateway.asks import Ask
from services.gateway.core import Gateway
from services.gateway.errors import GatewayError
from services.gateway.limits import read_body

ROUTE = "/ep/{episode_id}/v1/messages"
# Anthropic's error types by HTTP status (409, an ended episode, is a request that cannot be served: invalid)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages(path: str) -> bool:
    """Whether a request's path is this route's (its errors, the auth middleware's included, in Anthropic's shape)."""
    return path.startswith("/ep/") and path.rstrip("/").endswith("/v1/messages")


def error_body(exc: GatewayError) -> dict:
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: GatewayError) -> JSONResponse:
    headers = dict(exc.headers)
    # the anthropic client retries 409 and 5xx unless told not to: a request that cannot succeed is not retried
    headers.setdefault("x-should-retry", "true" if exc.status in (429, 503, 529) else "false")
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


class Answer:
    """A Messages request's call and what its answer needs: the model named, the stop sequences asked for."""

    def __init__(
        self, gw: Gateway, episode_id: str, chat: messages_request.Chat, call: int, prefill: str = "", seen=None
    ):
        self.gw, self.episode_id, self.chat, self.call = gw, episode_id, chat, call
        # a forced tool call's opening: the streamed text starts with it
        self.prefill = prefill
        # the episode's events as the request read them (Gateway.follow reads on from them)
        self.seen = seen
        self.id = f"msg_{episode_id}_{call}"

    def _stop_sequence(self, call) -> str | None:
        # a multi-token stop string the rollout worker matched, or a one-token one: the call's last token
        matched = getattr(call, "stop_string", None)
        if matched:
            return matched
        if call.reason != "stop" or not call.tokens or call.tokens[-1] in self.gw.renderer.stop_ids:
            return None
        for s in self.chat.stops:
            if self.gw.tok.encode(s, add_special_tokens=False) == [call.tokens[-1]]:
                return s
        return None

    def parts(self, call) -> tuple[str | None, list[dict], str, str | None]:
        """(text or None, tool_use blocks, stop_reason, stop_sequence) of a complete call."""
        message, _, problems = self.gw.answer(call)
        if problems:
            self.gw.log.warning(
                "tool call not parsed; answered as text", episode=self.episode_id, call=call.index, problems=problems
            )
        uses = [
            {
                "type": "tool_use",
                "id": f"toolu_{call.index}_{k}",
                "name": c["function"]["name"],
                "input": json.loads(c["function"]["arguments"]),
            }
            for k, c in enumerate(message.get("tool_calls") or [])
        ]
        sequence = None if uses else self._stop_sequence(call)
        if uses:
            reason = "tool_use"
        elif sequence is not None:
            reason = "stop_sequence"
        else:
            reason = "end_turn" if call.reason == "stop" else "max_tokens"
        return message.get("content"), uses, reason, sequence

    def whole(self, call) -> dict:
        text, uses, reason, sequence = self.parts(call)
        # never an empty content: a text block unless the answer is tool calls alone
        content = ([{"type": "text", "text": text}] if text or not uses else []) + uses
        return {
            **self._head(),
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(call.prompt_ids), "output_tokens": len(call.tokens)},
        }

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.chat.model}

    def events(self):
        """Anthropic's SSE events as the tokens land in the episode stream (across aborts and resumes)."""

        def event(kind: str, **data) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        gw, started, sent, blocks, text_open = self.gw, False, "", 0, False

        def start(prompt_len: int) -> str:
            message = {
                **self._head(),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_len, "output_tokens": 0},
            }
            return event("message_start", message=message)

        try:
            for kind, value in gw.follow(self.episode_id, self.call, 24 * 3600.0, self.seen):
                if kind == "stopping":
                    # the process is stopping: Anthropic's overloaded error (the agent runner reruns the agent)
                    stopping = GatewayError(
                        503, f"the gateway is stopping; call {self.call} is answered from its stream"
                    )
                    yield event("error", error=error_body(stopping)["error"])
                    return
                if kind == "wait":
                    # keeps proxies and clients from timing out during a sync
                    yield event("ping")
                elif kind == "tokens":
                    if not started:
                        opened = gw._episode(self.episode_id).calls.get(self.call)
                        yield start(len(opened.prompt_ids) if opened else 0)
                        started = True
                    text = gw.tok.decode(value, skip_special_tokens=True)
                    # short of a stop sequence (never shown), of a tool call's opening, and of a character whose
                    # bytes are still arriving
                    text = self.prefill + text[: stops.safe_len(text, self.chat.stops)]
                    upto = min(toolparse.safe_prefix_len(text), len(text.rstrip("\ufffd")))
                    if upto > len(sent) and text.startswith(sent):
                        if not text_open:
                            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                            text_open, blocks = True, 1
                        yield event(
                            "content_block_delta", index=0, delta={"type": "text_delta", "text": text[len(sent) : upto]}
                        )
                        sent = text[:upto]
                elif kind == "done":
                    call = value
                    if not started:
                        yield start(len(call.prompt_ids))
                    text, uses, reason, sequence = self.parts(call)
                    rest = self._rest(sent, text or "", bool(uses), call.index)
                    if rest or (not text_open and not uses):
                        if not text_open:
                            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                            text_open, blocks = True, 1
                        if rest:
                            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": rest})
                    if text_open:
                        yield event("content_block_stop", index=0)
                    for use in uses:
                        yield event("content_block_start", index=blocks, content_block={**use, "input": {}})
                        partial = json.dumps(use["input"])
                        yield event(
                            "content_block_delta",
                            index=blocks,
                            delta={"type": "input_json_delta", "partial_json": partial},
                        )
                        yield event("content_block_stop", index=blocks)
                        blocks += 1
                    usage = {"input_tokens": len(call.prompt_ids), "output_tokens": len(call.tokens)}
                    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage)
                    yield event("message_stop")
                    return
        except GatewayError as exc:
            yield event("error", error=error_body(exc)["error"])

    def _rest(self, sent: str, text: str, tools: bool, index: int) -> str:
        """What is left to stream of the answer's text after ``sent``. With tool calls the answer's text is the text
        around them, stripped: the streamed text plus the rest, stripped, is that text (how it maps back)."""
        if not tools:
            if text.startswith(sent):
                return text[len(sent) :]
        else:
            head = sent.lstrip()
            if text.startswith(head):
                return text[len(head) :]
            # the stream went into the whitespace after the text: nothing left
            if head.startswith(text) and not head[len(text) :].strip():
                return ""
        self.gw.log.warning("streamed text is not the answer's prefix", episode=self.episode_id, call=index)
        return ""


def prepare(gw: Gateway, episode_id: str, body, headers) -> Answer:
    """The call a Messages request asks for, made now or found made before."""
    chat = messages_request.read(body, gw.cfg.top_k)
    sampling = gw.sampling(
        model=chat.model,
        temperature=chat.temperature,
        top_p=chat.top_p,
        max_tokens=("max_tokens", chat.max_tokens),
        stop=("stop_sequences", chat.stops),
    )
    choice = gw.tool_choice(chat.tool_choice, chat.tools, "tool_choice")
    if chat.one_tool_call and chat.tools and choice != "none":
        # one tool call at most: the call ends at the first call's closing tag, kept in the answer's parse
        sampling = {**sampling, "stop_kept": [toolparse.CLOSE]}
    made = gw.chat_calls(episode_id, chat.messages, chat.tools, sampling, Ask.of(headers), 1, choice)
    return Answer(gw, episode_id, chat, made.calls[0], gw.prefill(choice), made.seen)


def route(gw: Gateway) -> Route:
    """The route that serves ``POST /ep/<episode>/v1/messages``."""

    async def messages(request: Request):
        episode_id = request.path_params["episode_id"]
        try:
            body = await read_body(request)
            answer = await threads.run(prepare, gw, episode_id, body, request.headers)
            if answer.chat.stream:
                return StreamingResponse(
                    answer.events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
                )
            call = await threads.run(gw.wait_done, episode_id, answer.call, answer.seen)
            return JSONResponse(answer.whole(call))
        except GatewayError as exc:
            return error_response(exc)

    return Route(ROUTE, messages, methods=["POST"])
