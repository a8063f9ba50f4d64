"""Messages -> prompt token ids, without ever re-tokenizing a sampled turn.

Pure functions over a tokenizer. A request whose messages extend an earlier
call's messages plus the assistant reply the gateway returned for it reuses
that call's exact prompt + completion ids and appends only the new messages,
rendered as a diff of the chat template (a fixed dummy conversation with and
without them, cut after its end-of-turn token: TRL's tool-suffix trick,
verl's ContinuousTokenBuilder). Anything else renders the whole conversation
(a fork). Messages are compared canonically: tool-call ids dropped, arguments
parsed as JSON, ``None`` and ``""`` content equal.

A call's answer is a pure function of its log: the completion ids, cut before
the stop string that ended it (``call_done``'s ``stop``, when it is one of the
sampling's ``stop``), after the ``prefill`` its messages JSON records (a forced
tool call's opening, sent as prompt tokens), parsed for tool calls unless its
``tool_choice`` was ``none``. A retry, a rerun, ``find_parent`` and a replay
all get the same answer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from services.gateway import stops, toolparse

DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
# a tool call the template renders, to read its opening from (tool_call_opening)
PROBE = "streamrl_probe_fn"


class RenderError(ValueError):
    """The chat template refused the messages (names the problem)."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def canonical(message: dict) -> dict:
    out = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "name": (c.get("function") or {}).get("name"),
                "arguments": _args((c.get("function") or {}).get("arguments")),
            }
            for c in calls
        ]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def digest(kind: str, payload: Any) -> str:
    return hashlib.sha256(json.dumps([kind, payload], sort_keys=True, default=str).encode()).hexdigest()[:32]


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as the chat template wants them (plain text content, arguments as objects)."""
    out = []
    for m in messages:
        t = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            t["tool_calls"] = [
                {
                    "type": "function",
                    "id": c.get("id", ""),
                    "function": {"name": c["function"]["name"], "arguments": _args(c["function"].get("arguments"))},
                }
                for c in m["tool_calls"]
            ]
        for k in ("name", "tool_call_id"):
            if m.get(k):
                t[k] = m[k]
        out.append(t)
    return out


def logged(call) -> dict:
    """A call's messages JSON (messages, tools, and tool_choice and prefill when set): {} when it has none."""
    try:
        out = json.loads(call.messages) if call.messages else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def cut_stop(call) -> str | None:
    """The stop string the answer is cut before: the one that ended the call, when the client asked for it (a
    ``stop_kept`` one, the gateway's own, stays in the answer)."""
    s = call.stop_string
    return s if s is not None and s in (call.sampling.get("stop") or ()) else None


def with_system_hint(messages: list[dict], hint: str) -> list[dict]:
    """``messages`` with ``hint`` appended to a leading system (or developer) message, or in a system message of
    its own before them (the prompt-side hint of a ``response_format``)."""
    first = messages[0] if messages else {}
    if first.get("role") not in ("system", "developer"):
        return [{"role": "system", "content": hint}, *messages]
    content = first.get("content") or ""
    if isinstance(content, list):
        # content parts: one more text part (the template reads the parts' text joined)
        return [{**first, "content": [*content, {"type": "text", "text": f"\n\n{hint}"}]}, *messages[1:]]
    return [{**first, "content": f"{content}\n\n{hint}" if content else hint}, *messages[1:]]


class Renderer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        vocab = tokenizer.get_vocab()
        self.end_text = "<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token
        self.end_id = vocab.get(self.end_text, tokenizer.eos_token_id)
        self.stop_ids = sorted({i for i in (self.end_id, tokenizer.eos_token_id) if i is not None})
        if not getattr(tokenizer, "chat_template", None):
            raise RenderError("the model's tokenizer has no chat template (tokenizer_config.json: chat_template)")
        # a fast tokenizer's own encoder, called directly: the same ids without transformers' batching wrapper,
        # which costs more than the encoding of a short prompt
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._encode = (
            (lambda text: backend.encode(text, add_special_tokens=False).ids)
            if backend is not None
            else (lambda text: tokenizer.encode(text, add_special_tokens=False))
        )
        # the dummy conversation a bridge is cut from, rendered once per tool list
        self._bases: dict[str, str] = {}

    def _apply(self, messages, tools, generation: bool) -> str:
        try:
            return self.tok.apply_chat_template(
                template_messages(messages), tools=tools or None, add_generation_prompt=generation, tokenize=False
            )
        # jinja raises its own kinds, templates raise_exception(...)
        except Exception as exc:
            raise RenderError(f"the chat template refused the messages: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def full(self, messages: list[dict], tools) -> list[int]:
        return self.encode(self._apply(messages, tools, True))

    def bridge(self, parent_ended: bool, new_messages: list[dict], tools) -> list[int] | None:
        """Tokens that follow a completed assistant turn to append ``new_messages`` and open the next assistant
        turn; None when the template does not render them as an append (then the caller forks)."""
        known = json.dumps(tools, sort_keys=True)
        base = self._bases.get(known)
        if base is None:
            # kept for a bounded number of tool lists (an agent keeps one; a client making up new ones each call
            # costs a render each, as before)
            if len(self._bases) >= 64:
                self._bases.clear()
            base = self._bases[known] = self._apply(DUMMY, tools, False)
        full = self._apply(DUMMY + new_messages, tools, True)
        cut = base.rfind(self.end_text)
        if cut < 0 or not full.startswith(base[: cut + len(self.end_text)]):
            return None
        ids = self.encode(full[cut + len(self.end_text) :])
        return ids if parent_ended else [self.end_id, *ids]

    def text(self, call) -> str:
        """A complete call's completion text as answered: decoded, cut before the client's stop string."""
        return stops.cut(self.tok.decode(call.tokens, skip_special_tokens=True), cut_stop(call))

    def answer(self, call) -> tuple[dict, list[str]]:
        """The assistant message the gateway answers for a complete call, from its log alone."""
        opts = logged(call)
        return self.assistant(
            call.tokens,
            call.index,
            text=str(opts.get("prefill") or "") + self.text(call),
            parse_tools=opts.get("tool_choice") != "none",
        )

    def tool_call_opening(self, name: str | None = None) -> str | None:
        """The text the template puts before a tool call's arguments (``<tool_call>`` and whatever follows it up
        to the JSON; with ``name``, also ``{"name": "<name>", "arguments": ``), read from a rendered tool call;
        None when the template does not write Hermes-style ``<tool_call>`` blocks."""
        probe = {"type": "function", "function": {"name": PROBE, "parameters": {"type": "object"}}}
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "p", **probe, "function": {"name": PROBE, "arguments": "{}"}}],
        }
        try:
            text = self._apply(DUMMY[:1] + [call], [probe], False)
        except RenderError:
            return None
        at = text.find(toolparse.OPEN)
        named = text.find(json.dumps(PROBE), at)
        if at < 0 or named < 0:
            return None
        head = text[at:named]
        brace = head.rfind("{")
        if brace < 0 or not head[brace:].replace(" ", "").startswith('{"name":'):
            return None
        if name is None:
            return head[:brace]
        after = named + len(json.dumps(PROBE))
        args = text.find("{}", after)
        if args < 0 or '"arguments"' not in text[after:args]:
            return None
        return head + json.dumps(name) + text[after:args]

    def assistant(
        self, completion_ids: list[int], call_index: int, *, text: str | None = None, parse_tools: bool = True
    ) -> tuple[dict, list[str]]:
        """The assistant message the gateway answers for a completion (deterministic: a retry gets the same);
        ``text`` the answer's text when it is not the completion's (``answer``: cut, after a prefill)."""
        if text is None:
            text = self.tok.decode(completion_ids, skip_special_tokens=True)
        if not parse_tools:
            return {"role": "assistant", "content": text}, []
        parsed = toolparse.parse(text)
        message: dict = {
            "role": "assistant",
            "content": parsed.content if (parsed.content or not parsed.calls) else None,
        }
        if parsed.calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{call_index}_{k}",
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for k, c in enumerate(parsed.calls)
            ]
        return message, parsed.problems


def find_parent(calls: dict, messages: list[dict], tools, renderer: Renderer):
    """(parent call, new messages) when ``messages`` extend a complete call's messages + its answer; else None."""
    want = [canonical(m) for m in messages]
    for call in sorted(calls.values(), key=lambda c: c.index, reverse=True):
        if not call.done or not call.messages:
            continue
        try:
            logged = json.loads(call.messages)
        except ValueError:
            continue
        if logged.get("tools") != tools:
            continue
        answer, _ = renderer.answer(call)
        prev = [canonical(m) for m in logged.get("messages", [])] + [canonical(answer)]
        if len(want) > len(prev) and want[: len(prev)] == prev:
            return call, messages[len(prev) :]
    return None
