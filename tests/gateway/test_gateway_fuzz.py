"""The gateway under hostile requests: every bad body is a 4xx naming what is wrong, never a 5xx; keys are
checked per episode; bodies are limited in size and depth."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.gateway.app import make_app
from services.gateway.core import Gateway
from services.gateway.limits import MAX_BODY, MAX_DEPTH
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
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "n",
    "stream",
    "logprobs",
    "tools",
    "stream_options",
    "prompt",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_logprobs",
    "modalities",
    "audio",
    "reasoning_effort",
    "user",
    "metadata",
    "store",
    "echo",
]
BASE = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGE_FIELDS = ["role", "content", "tool_calls", "tool_call_id", "name"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"), max_len=160)


@pytest.fixture
def http(chat_dir, client, keys):
    tok = AutoTokenizer.from_pretrained(chat_dir)
    gw = Gateway(
        Config(run=keys.run, model_dir=chat_dir, gateway_timeout=5.0),
        client,
        tok,
        160,
        ["chat"],
        logs.get("gateway-fuzz"),
    )
    # ended: a request that passes every check is a 409, never a wait
    start_agent_episode(client, keys, "g-0")
    log = EpisodeLog(client, keys, "fuzz")
    log.open("g-0", 1)
    log.append("g-0", "finished", {"reason": "stop", "reward": 0.0}, 0)
    log.flush_or_raise()
    return TestClient(make_app(gw, api_key=KEY))


def _auth(episode: str = "g-0") -> dict:
    return {"authorization": f"Bearer {secrets.episode_key(KEY, episode)}", "content-type": "application/json"}


def _check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


def test_fuzzed_requests_get_4xx_never_5xx(http):
    """>= 2,000 requests in CI (a quarter in a developer's run: tests/support/fuzz.py): random values in every field
    of a chat call, in a message's fields, random bodies."""
    sent = []

    @settings(max_examples=cases(800), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        field=st.sampled_from(FIELDS),
        value=JSON,
        where=st.sampled_from(["body", "message", "completion"]),
        mfield=st.sampled_from(MESSAGE_FIELDS),
    )
    def fuzz_field(field, value, where, mfield):
        if where == "body":
            body, route = {**BASE, field: value}, "chat/completions"
        elif where == "message":
            body, route = {"messages": [{"role": "user", "content": "hi", mfield: value}]}, "chat/completions"
        else:
            body, route = {"prompt": "1+1=", field: value}, "completions"
        _check(http.post(f"/ep/g-0/v1/{route}", content=json.dumps(body), headers=_auth()))
        sent.append(1)

    @settings(max_examples=cases(1200), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        raw=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)),
        route=st.sampled_from(["chat/completions", "completions"]),
    )
    def fuzz_body(raw, route):
        _check(http.post(f"/ep/g-0/v1/{route}", content=raw, headers=_auth()))
        sent.append(1)

    fuzz_field()
    fuzz_body()
    assert len(sent) >= cases(800) + cases(1200)


@pytest.mark.parametrize(
    "raw, code",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "invalid_json"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', "invalid_type"),
        (b"[" * 50_000 + b"]" * 50_000, "invalid_json"),
        (
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi", "x": [[[[]]]] * 2}],
                    "deep": json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)),
                }
            ).encode(),
            "invalid_json",
        ),
        (json.dumps({**BASE, "messages": [{"role": "assistant", "tool_calls": 5}]}).encode(), None),
        (json.dumps({**BASE, "tools": [{"function": "x"}]}).encode(), None),
    ],
)
def test_the_reported_bodies_are_4xx(http, raw, code):
    r = http.post("/ep/g-0/v1/chat/completions", content=raw, headers=_auth())
    assert r.status_code == 400, r.text
    if code:
        assert r.json()["error"]["code"] == code


def test_body_size_limit_and_per_episode_keys(http):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * (MAX_BODY + 1) + b'"}]}'
    r = http.post("/ep/g-0/v1/chat/completions", content=big, headers=_auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    body = json.dumps(BASE)
    # its own
    assert http.post("/ep/g-0/v1/chat/completions", content=body, headers=_auth()).status_code == 409
    # another episode's
    other = http.post("/ep/h-0/v1/chat/completions", content=body, headers=_auth("g-0"))
    assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
    # an episode key is not the gateway's key
    assert http.get("/v1/models", headers=_auth()).status_code == 401
    assert http.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
