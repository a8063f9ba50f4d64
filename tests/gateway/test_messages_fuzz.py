"""The Messages route under hostile requests: every bad body is a 4xx in Anthropic's error shape whose message names
the field, never a 5xx; the auth middleware's and the size limit's refusals in the same shape; a 503 says retry."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.gateway.app import make_app
from services.gateway.core import Gateway
from services.gateway.limits import MAX_BODY
from services.gateway.runner import lost_gateway
from shared.protocol.episode.log import EpisodeLog
from shared.runtime import logs, secrets
from shared.runtime.config.keys import Config
from tests.support.chat_models import make_chat_model
from tests.support.fuzz import cases
from tests.support.gateway_stack import start_agent_episode

KEY = "gateway-key"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "system",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "service_tier",
    "thinking",
    "not_a_field",
]
BASE = {"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
BLOCKS = {
    "text": {"type": "text", "text": "x"},
    "tool_use": {"type": "tool_use", "id": "t", "name": "calc", "input": {"e": "1"}},
    "tool_result": {"type": "tool_result", "tool_use_id": "t", "content": "5"},
    "image": {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}},
}
# Anthropic's error type by status, as the route answers them
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"), max_len=160)


def _gateway(chat_dir, client, keys, timeout: float) -> Gateway:
    tok = AutoTokenizer.from_pretrained(chat_dir)
    cfg = Config(run=keys.run, model_dir=chat_dir, gateway_timeout=timeout)
    return Gateway(cfg, client, tok, 160, ["chat"], logs.get("messages-fuzz"))


@pytest.fixture
def http(chat_dir, client, keys):
    gw = _gateway(chat_dir, client, keys, 5.0)
    # ended: a request that passes every check is a 409, never a wait
    start_agent_episode(client, keys, "g-0")
    log = EpisodeLog(client, keys, "fuzz")
    log.open("g-0", 1)
    log.append("g-0", "finished", {"reason": "stop", "reward": 0.0}, 0)
    log.flush_or_raise()
    return TestClient(make_app(gw, api_key=KEY))


def _auth(episode: str = "g-0") -> dict:
    return {"x-api-key": secrets.episode_key(KEY, episode), "anthropic-version": "2023-06-01"}


def _check(r, names: str | None = None) -> None:
    """Never a 5xx; a 4xx in Anthropic's shape, its message naming ``names`` (the field at fault) when given."""
    assert r.status_code < 500, r.text
    if r.status_code < 400:
        return
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == TYPES[r.status_code], r.text
    message = body["error"]["message"]
    assert message
    # a valid request reaches the ended episode: the 409 names none
    if names is not None and r.status_code != 409:
        # (json.dumps writes an infinite float as Infinity: not JSON, refused before any field is read)
        infinite = message.startswith("request body: ") and "Infinity is not a JSON number" in message
        assert message.startswith(names) or infinite, (names, message)


def _post(http, body) -> object:
    return http.post("/ep/g-0/v1/messages", content=json.dumps(body), headers=_auth())


def test_fuzzed_messages_requests_get_4xx_naming_the_field_never_5xx(http):
    """>= 2,000 requests in CI (a tenth in a developer's run: tests/support/fuzz.py): random values in every field
    of a Messages request, in a message's fields, in a content block's fields; random bodies."""
    sent = []

    @settings(max_examples=cases(700), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(field=st.sampled_from(FIELDS), value=JSON)
    def fuzz_field(field, value):
        _check(_post(http, {**BASE, field: value}), field)
        sent.append(1)

    @settings(max_examples=cases(300), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(mfield=st.sampled_from(["role", "content", "other"]), value=JSON)
    def fuzz_message(mfield, value):
        _check(_post(http, {**BASE, "messages": [{"role": "user", "content": "hi", mfield: value}]}), "messages[0]")
        sent.append(1)

    @settings(max_examples=cases(500), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        role=st.sampled_from(["user", "assistant"]),
        kind=st.sampled_from(sorted(BLOCKS)),
        bfield=st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "is_error", "x"]),
        value=JSON,
    )
    def fuzz_block(role, kind, bfield, value):
        block = {**BLOCKS[kind], bfield: value}
        turns = [
            {"role": "user", "content": "hi"},
            {"role": role, "content": [block]},
            {"role": "user", "content": "go"},
        ]
        _check(_post(http, {**BASE, "messages": turns}), "messages[1].content[0]")
        sent.append(1)

    @settings(max_examples=cases(500), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)))
    def fuzz_body(raw):
        _check(http.post("/ep/g-0/v1/messages", content=raw, headers=_auth()))
        sent.append(1)

    fuzz_field()
    fuzz_message()
    fuzz_block()
    fuzz_body()
    assert len(sent) >= cases(700) + cases(300) + cases(500) + cases(500)


@pytest.mark.parametrize(
    "change, names",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": 5}, "top_k"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": [BLOCKS["image"]]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "thinking"}]}]},
            "messages[1].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages[1].role"),
        ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role"),
        ({"model": "claude-sonnet-4"}, "model"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(http, change, names):
    body = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    r = _post(http, body)
    assert r.status_code == (404 if names == "model" else 400), r.text
    _check(r, names)
    assert r.headers["x-should-retry"] == "false"


def test_keys_and_size_limit_answer_in_anthropics_shape(http):
    # its own key, as x-api-key: through to the (ended) episode
    ok = _post(http, BASE)
    assert ok.status_code == 409 and ok.json()["error"]["type"] == "invalid_request_error"
    wrong = http.post("/ep/g-0/v1/messages", content=json.dumps(BASE), headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in wrong.json()["error"]["message"]
    # another episode's key
    other = http.post("/ep/h-0/v1/messages", content=json.dumps(BASE), headers=_auth("g-0"))
    assert other.status_code == 401 and other.json()["type"] == "error"
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (MAX_BODY + 1) + b'"}]}'
    r = http.post("/ep/g-0/v1/messages", content=big, headers=_auth())
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # the chat route keeps OpenAI's shape
    chat = http.post("/ep/g-0/v1/chat/completions", content=json.dumps(BASE), headers={"x-api-key": "nope"})
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"


def test_a_held_call_is_a_503_the_client_retries_and_a_stopping_gateway_ends_a_stream_with_an_overloaded_error(
    chat_dir, client, keys
):
    """No rollout worker: the call is held past gateway_timeout, a 503 overloaded_error with x-should-retry; a
    stream under a stopping gateway ends with Anthropic's overloaded error event, which the agent runner reads as a
    lost gateway (it reruns the agent)."""
    import anthropic
    import httpx2

    gw = _gateway(chat_dir, client, keys, 0.5)
    start_agent_episode(client, keys, "held-0")
    http = TestClient(make_app(gw, api_key=KEY))
    r = http.post("/ep/held-0/v1/messages", content=json.dumps(BASE), headers=_auth("held-0"))
    assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error", r.text
    assert r.headers["x-should-retry"] == "true"
    gw.stopping.set()
    streamed = http.post(
        "/ep/held-0/v1/messages", content=json.dumps({**BASE, "stream": True}), headers=_auth("held-0")
    )
    assert streamed.status_code == 200
    assert streamed.text.startswith("event: error\ndata: ")
    body = json.loads(streamed.text.split("data: ", 1)[1])
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    # as the anthropic client raises it from the stream (its status is the stream's: 200)
    response = httpx2.Response(200, request=httpx2.Request("POST", "http://gw/ep/held-0/v1/messages"))
    assert lost_gateway(anthropic.APIStatusError("stopping", response=response, body=body))
