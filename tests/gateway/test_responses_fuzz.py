"""The Responses API under hostile requests: every bad body is a 4xx naming the field that is wrong (the field the
fuzz broke, or one inside it), never a 5xx."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.gateway.app import make_app
from services.gateway.core import Gateway
from shared.protocol.episode.log import EpisodeLog
from shared.runtime import logs, secrets
from shared.runtime.config.keys import Config
from tests.support.chat_models import make_chat_model
from tests.support.fuzz import cases
from tests.support.gateway_stack import start_agent_episode

KEY = "gateway-key"
ROUTE = "/ep/g-0/v1/responses"
WORDS = st.sampled_from(
    ["message", "function_call", "function_call_output", "user", "assistant", "developer", "input_text", "text", ""]
)
# finite numbers: a non-finite one is a body the parser refuses before any field (the chat fuzz sends those)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | WORDS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | WORDS, inner, max_size=3),
    max_leaves=8,
)
FIELDS = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "previous_response_id",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "store",
    "truncation",
    "reasoning",
    "include",
    "text",
    "metadata",
    "user",
    "conversation",
    "background",
    "top_logprobs",
]
ITEM_FIELDS = ["type", "role", "content", "call_id", "name", "arguments", "output", "id"]
TOOL_FIELDS = ["type", "name", "description", "parameters", "strict"]
BASE = {"model": "chat", "input": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "name": "calc", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"), max_len=160)


@pytest.fixture
def http(chat_dir, client, keys):
    tok = AutoTokenizer.from_pretrained(chat_dir)
    gw = Gateway(
        Config(run=keys.run, model_dir=chat_dir, gateway_timeout=5.0), client, tok, 160, ["chat"], logs.get("fuzz")
    )
    # ended: a request that passes every check is a 409, never a wait
    start_agent_episode(client, keys, "g-0")
    log = EpisodeLog(client, keys, "fuzz")
    log.open("g-0", 1)
    log.append("g-0", "finished", {"reason": "stop", "reward": 0.0}, 0)
    log.flush_or_raise()
    return TestClient(make_app(gw, api_key=KEY))


def _auth() -> dict:
    return {"authorization": f"Bearer {secrets.episode_key(KEY, 'g-0')}", "content-type": "application/json"}


def _check(r, names: str) -> None:
    """No 5xx; a refusal of the request's content (400, 404: an unknown model) names ``names`` or a field in it."""
    assert r.status_code < 500, r.text
    if r.status_code in (400, 404):
        err = r.json()["error"]
        named = err["param"] or err["message"].split(":")[0]
        assert err["message"] and named.startswith(names), (names, err)
    else:
        # a body that passes every check meets the ended episode
        assert r.status_code in (200, 409), r.text


def test_fuzzed_responses_requests_get_4xx_naming_the_field_never_5xx(http):
    """>= 2,000 requests in CI (a tenth in a developer's run: tests/support/fuzz.py): random values in every field of
    a Responses request, in an input item's and a tool's fields, random lists of items, random bodies."""
    sent = []

    @settings(max_examples=cases(900), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(field=st.sampled_from(FIELDS), value=JSON)
    def fuzz_field(field, value):
        r = http.post(ROUTE, content=json.dumps({**BASE, field: value}), headers=_auth())
        _check(r, field)
        sent.append(1)

    @settings(max_examples=cases(500), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(
        where=st.sampled_from(["input", "tools"]),
        item=st.sampled_from(ITEM_FIELDS),
        tool=st.sampled_from(TOOL_FIELDS),
        value=JSON,
    )
    def fuzz_inner(where, item, tool, value):
        if where == "input":
            body = {**BASE, "input": [{"role": "user", "content": "hi", item: value}]}
        else:
            body = {**BASE, "tools": [{**TOOL, tool: value}]}
        _check(http.post(ROUTE, content=json.dumps(body), headers=_auth()), f"{where}[0]")
        sent.append(1)

    @settings(max_examples=cases(300), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(items=st.lists(st.dictionaries(st.sampled_from(ITEM_FIELDS), JSON, max_size=5) | JSON, max_size=4))
    def fuzz_items(items):
        _check(http.post(ROUTE, content=json.dumps({**BASE, "input": items}), headers=_auth()), "input")
        sent.append(1)

    @settings(max_examples=cases(300), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(raw=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=64)))
    def fuzz_body(raw):
        r = http.post(ROUTE, content=raw, headers=_auth())
        assert r.status_code < 500, r.text
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
        sent.append(1)

    fuzz_field()
    fuzz_inner()
    fuzz_items()
    fuzz_body()
    assert len(sent) >= cases(900) + cases(500) + cases(300) + cases(300)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": 5}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "calc"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"input": "hi", "previous_response_id": "resp_0_0000000000000000"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": True}, "temperature"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
    ],
)
def test_each_refusal_names_its_field(http, body, param):
    r = http.post(ROUTE, content=json.dumps({"model": "chat", **body}), headers=_auth())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_what_is_accepted_and_ignored_meets_the_ended_episode(http):
    """metadata, user, store, include [] and a function tool pass every check (the episode has ended: 409)."""
    body = {
        **BASE,
        "instructions": "be brief",
        "tools": [TOOL],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "include": [],
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "metadata": {"k": "v"},
        "user": "u1",
    }
    r = http.post(ROUTE, content=json.dumps(body), headers=_auth())
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_ended", r.text
