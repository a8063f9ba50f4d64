"""Gateway pieces without processes: tool-call parsing, template diffs, canonical matching, bad requests."""

import copy
import json

import pytest
import redis
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from services.gateway import fields, toolparse
from services.gateway import stops as gw_stops
from services.gateway.app import make_app
from services.gateway.asks import Ask, Asks
from services.gateway.chat import Renderer, canonical, template_messages, with_system_hint
from services.gateway.core import Gateway
from services.gateway.errors import GatewayError
from shared.protocol.episode.fold import Call
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams import calls as calls_codec
from shared.runtime import logs, secrets
from shared.runtime.config.keys import Config
from tests.support.chat_models import CALC_TOOL, calc_conversation, make_chat_model, tool_call_message
from tests.support.gateway_stack import free_port, start_agent_episode


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("chat"), max_len=160)


@pytest.fixture(scope="module")
def tok(chat_dir):
    return AutoTokenizer.from_pretrained(chat_dir)


def test_hermes_tool_calls_are_parsed_and_bad_ones_stay_text():
    p = toolparse.parse('ok <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>')
    assert p.content == "ok" and p.calls == [{"name": "calc", "arguments": '{"e": "1+2"}'}]
    two = toolparse.parse(
        '<tool_call>{"name": "a", "arguments": "{}"}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    assert [c["name"] for c in two.calls] == ["a", "b"] and two.content == ""
    bad = toolparse.parse('<tool_call>{"name": "calc", "arguments": {"e": </tool_call>')
    assert bad.calls == [] and bad.problems and bad.content.startswith("<tool_call>")
    thought = toolparse.parse('<think><tool_call>{"name": "x"}</tool_call></think>done')
    assert thought.calls == []
    assert toolparse.safe_prefix_len("abc <tool") == 4 and toolparse.safe_prefix_len("abc <tool_call>{") == 4
    assert toolparse.safe_prefix_len("a < b") == 5


def test_bridge_appends_exactly_what_a_full_render_would(tok):
    r = Renderer(tok)
    conv = calc_conversation(2, 3)
    tools = [CALC_TOOL]
    first = r.full(conv[:1], tools)
    completion = tok.encode(
        tok.apply_chat_template(template_messages(conv[:2]), tools=tools, tokenize=False), add_special_tokens=False
    )[len(first) :]
    # what the engine returns: up to the stop token
    completion = completion[: completion.index(r.end_id) + 1]
    bridge = r.bridge(True, conv[2:3], tools)
    assert first + completion + bridge == r.full(conv[:3], tools)
    # a turn cut by length gets its end token
    assert r.bridge(False, conv[2:3], tools)[0] == r.end_id
    message, problems = r.assistant(completion, 0)
    assert not problems and canonical(message) == canonical(conv[1])


def test_renderer_encodes_as_the_tokenizer_does_and_bridges_per_tool_list(tok):
    r = Renderer(tok)
    texts = [
        "",
        "What is 12+30? Think step by step.",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "  leading and trailing spaces  \n\n",
        'unicode: é ü 数 🙂, and <tool_call>{"name": "calc"}</tool_call>',
    ]
    for text in texts:
        assert r.encode(text) == tok.encode(text, add_special_tokens=False), text
    # the bridge's rendered dummy is kept per tool list: another list bridges as a renderer that never saw the first
    conv = calc_conversation(2, 3)
    with_tools = r.bridge(True, conv[2:3], [CALC_TOOL])
    without = r.bridge(True, conv[2:3], None)
    assert with_tools == Renderer(tok).bridge(True, conv[2:3], [CALC_TOOL])
    assert without == Renderer(tok).bridge(True, conv[2:3], None)


def test_canonical_ignores_ids_and_argument_formatting():
    a = tool_call_message("1+2", call_id="a")
    b = {**tool_call_message("1+2", call_id="b"), "content": None}
    b["tool_calls"][0]["function"]["arguments"] = json.dumps({"e": "1+2"}, indent=2)
    assert canonical(a) == canonical(b)


@pytest.fixture
def http(chat_dir, tok, client, keys):
    cfg = Config(run=keys.run, model_dir=chat_dir)
    gw = Gateway(cfg, client, tok, 160, ["chat", "policy"], logs.get("gateway-test"))
    start_agent_episode(client, keys, "g-0")
    return TestClient(make_app(gw))


def _post(http, body, episode="g-0", raw=None):
    return http.post(
        f"/ep/{episode}/v1/chat/completions",
        content=raw if raw is not None else json.dumps(body),
        headers={"content-type": "application/json"},
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 257]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a<|im_end|>"]}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 1 << 64}, 400, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools[0].function"),
        # over the 160-token context
        ({"messages": [{"role": "user", "content": "x" * 200}]}, 400, "messages"),
        # what would change the answer and cannot be honoured is refused, never dropped
        # a tool call cannot be forced without tools, nor one the request does not offer
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [CALC_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "search"}},
            },
            400,
            "tool_choice.function.name",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [CALC_TOOL], "tool_choice": "any"},
            400,
            "tool_choice",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "grammar"}},
            400,
            "response_format.type",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
            400,
            "response_format.json_schema",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "response_format": "json"}, 400, "response_format"),
        ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -1}, 400, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 10}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}}, 400, "audio"),
        ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, 400, "modalities"),
        ({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "high"}, 400, "reasoning_effort"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"chunk_size": 3}},
            400,
            "stream_options.chunk_size",
        ),
    ],
)
def test_bad_requests_name_the_field(http, client, keys, body, status, param):
    r = _post(http, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    # nothing was handed to the workers
    assert not client.exists(keys.calls)


def test_malformed_json_unknown_episode_and_models(http):
    r = _post(http, None, raw=b"{not json")
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = _post(http, {"messages": [{"role": "user", "content": "hi"}]}, episode="nope-0")
    assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"
    assert [m["id"] for m in http.get("/ep/g-0/v1/models").json()["data"]] == ["chat", "policy"]
    r = _post(http, {"messages": [{"role": "user", "content": "x" * 200}]})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_api_key_is_required_when_set(chat_dir, tok, client, keys):
    cfg = Config(run=keys.run, model_dir=chat_dir)
    gw = Gateway(cfg, client, tok, 160, ["chat"], logs.get("gateway-test"))
    http = TestClient(make_app(gw, api_key="sesame"))
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"authorization": "Bearer sesame"}).status_code == 200
    # Anthropic's clients send the key as x-api-key; a wrong Bearer beside it does not hide it
    assert http.get("/v1/models", headers={"x-api-key": "sesame"}).status_code == 200
    assert http.get("/v1/models", headers={"x-api-key": "sesame", "authorization": "Bearer no"}).status_code == 200
    assert http.get("/v1/models", headers={"x-api-key": "no"}).status_code == 401
    episode = secrets.episode_key("sesame", "g-0")
    assert http.get("/ep/g-0/v1/models", headers={"x-api-key": episode}).status_code == 200
    assert http.get("/ep/g-1/v1/models", headers={"x-api-key": episode}).status_code == 401


def test_what_changes_nothing_passes_tool_choice_auto_and_text_format(chat_dir, tok, client, keys):
    """``auto``, ``none`` without tools, ``{'type': 'text'}``, platform bookkeeping (``user``, ``metadata``,
    ``store``...) and no-op values of what the gateway refuses otherwise: the call is made, its sampling and
    prompt as without them."""
    gw = Gateway(Config(run=keys.run, model_dir=chat_dir), client, tok, 160, ["chat"], logs.get("gateway-test"))
    start_agent_episode(client, keys, "g-1")
    extras = (
        {"tool_choice": "auto", "tools": [CALC_TOOL]},
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "prediction": {"x": 1}},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "top_logprobs": 0, "modalities": ["text"]},
        {"stream_options": {"include_usage": True, "include_obfuscation": False}, "parallel_tool_calls": True},
    )
    plain = None
    for k, extra in enumerate(extras):
        prep = gw.prepare_chat("g-1", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
        assert prep.call == k and client.xlen(keys.calls) == k + 1
        req = _request(client, keys, -1)
        if "tools" not in extra:
            plain = plain or req
            assert (req.prompt_ids, req.sampling) == (plain.prompt_ids, plain.sampling)
    assert set(fields.NOOP) & set(fields.REFUSED) == set()


def _request(client, keys, at: int):
    entry_id, data = client.xrange(keys.calls)[at]
    return calls_codec.decode_request(entry_id, data)


def test_tool_choice_response_format_stops_and_seed_shape_the_call(chat_dir, tok, client, keys):
    """What each honoured field puts in the call the workers get: a forced tool call's opening as prompt tokens
    (logged with the call), ``stop_kept`` for ``parallel_tool_calls: false``, the stop strings and seed in the
    sampling (a special token's text as its id), the JSON hint in the prompt."""
    gw = Gateway(Config(run=keys.run, model_dir=chat_dir), client, tok, 160, ["chat"], logs.get("gateway-test"))
    start_agent_episode(client, keys, "g-2")
    user = [{"role": "user", "content": "hi"}]
    plain = gw.renderer.full(user, [CALC_TOOL])

    def made(**extra):
        gw.prepare_chat("g-2", {"messages": user, "tools": [CALC_TOOL], "max_tokens": 4, **extra})
        req = _request(client, keys, -1)
        return req, json.loads(req.messages)

    req, logged = made(tool_choice="required")
    opening = gw.renderer.tool_call_opening()
    assert opening.startswith(toolparse.OPEN) and logged["prefill"] == opening
    assert req.prompt_ids == plain + gw.renderer.encode(opening) and logged["tool_choice"] == "required"
    req, logged = made(tool_choice={"type": "function", "function": {"name": "calc"}})
    assert logged["prefill"].startswith(opening) and logged["prefill"].endswith('"arguments": ')
    assert '"calc"' in logged["prefill"] and req.prompt_ids == plain + gw.renderer.encode(logged["prefill"])
    req, logged = made(tool_choice="none")
    assert req.prompt_ids == plain and logged["tool_choice"] == "none" and "prefill" not in logged
    req, _ = made(parallel_tool_calls=False)
    assert req.sampling["stop_kept"] == [toolparse.CLOSE] and req.prompt_ids == plain
    req, _ = made(stop=["ab c", "<|im_end|>", "ab c"], seed=7)
    assert req.sampling["stop"] == ["ab c"] and req.sampling["seed"] == 7
    assert tok.convert_tokens_to_ids("<|im_end|>") in req.sampling["stop_token_ids"]
    req, logged = made(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    )
    assert logged["messages"][0]["role"] == "system" and '{"type": "object"}' in logged["messages"][0]["content"]
    assert tok.decode(req.prompt_ids).count("JSON schema") == 1
    # a template that writes no <tool_call> blocks cannot be prefilled: refused, naming the field
    other = copy.deepcopy(tok)
    other.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    gw2 = Gateway(Config(run=keys.run, model_dir=chat_dir), client, other, 160, ["chat"], logs.get("gateway-test"))
    with pytest.raises(GatewayError) as err:
        gw2.prepare_chat("g-2", {"messages": user, "tools": [CALC_TOOL], "tool_choice": "required"})
    assert err.value.param == "tool_choice" and "<tool_call>" in err.value.message


def test_answers_are_cut_before_the_stop_string_and_parsed_after_the_prefill(chat_dir, tok):
    """The answer from a call's log alone: cut before the client's stop string (a kept one stays), the logged
    prefill before the completion, tool calls left unparsed under tool_choice none."""
    r = Renderer(tok)
    ids = tok.encode('{"e": "1"}}</tool_call> and more', add_special_tokens=False)
    named = r.tool_call_opening("calc")
    call = Call(0, -1, [1], [1], "d", {"stop": ["and"]}, json.dumps({"prefill": named}), tokens=ids, done=True)
    call.stop_string = "and"
    message, problems = r.answer(call)
    assert not problems and message["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"e": "1"}'}
    assert r.text(call) == '{"e": "1"}}</tool_call> '
    kept = Call(0, -1, [1], [1], "d", {"stop_kept": ["and"]}, "", tokens=ids, done=True, stop_string="and")
    assert r.text(kept) == tok.decode(ids)
    none = Call(1, -1, [1], [1], "d", {}, json.dumps({"tool_choice": "none", "prefill": ""}), tokens=ids, done=True)
    assert r.answer(none)[0] == {"role": "assistant", "content": tok.decode(ids)}


def test_a_format_hint_joins_the_leading_system_message_or_comes_first():
    user = {"role": "user", "content": "hi"}
    assert with_system_hint([user], "H") == [{"role": "system", "content": "H"}, user]
    assert with_system_hint([{"role": "system", "content": "S"}, user], "H")[0]["content"] == "S\n\nH"
    parts = with_system_hint([{"role": "developer", "content": [{"type": "text", "text": "S"}]}, user], "H")
    assert canonical(parts[0])["content"] == "S\n\nH" and parts[1] == user


def test_stop_strings_hold_back_what_may_become_one():
    assert gw_stops.safe_len("hello wor", ["world"]) == 6 and gw_stops.safe_len("hello world!", ["world"]) == 6
    assert gw_stops.safe_len("abc", []) == 3 and gw_stops.safe_len("ab", ["abc", "b"]) == 1
    assert gw_stops.cut("a STOP b STOP", "STOP") == "a " and gw_stops.cut("abc", None) == "abc"


def test_an_agent_that_lost_the_gateway_is_told_from_one_that_failed_on_its_own():
    """Connection errors of any SDK, raised directly or wrapped by a framework, and 5xx answers are the gateway's;
    the agent's own errors (and 4xx: a bad request is the agent's) are not."""
    import http.client

    import httpx
    import openai

    from services.gateway.runner import lost_gateway

    request = httpx.Request("POST", "http://127.0.0.1:1/ep/e/v1/chat/completions")

    def wrapped(inner: BaseException, outer: type[Exception] = RuntimeError) -> Exception:
        try:
            try:
                raise inner
            except BaseException as exc:
                raise outer("the framework's own error") from exc
        except Exception as exc:
            return exc

    def status(code: int) -> openai.APIStatusError:
        return openai.APIStatusError("x", response=httpx.Response(code, request=request), body=None)

    lost = [
        openai.APIConnectionError(request=request),
        httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
        httpx.ConnectError("refused"),
        http.client.RemoteDisconnected("gone"),
        ConnectionResetError(104, "reset"),
        wrapped(httpx.ReadError("gone")),
        status(503),
        wrapped(status(500), ValueError),
    ]
    own = [ValueError("bad answer"), KeyError("e"), status(400), status(404), wrapped(ZeroDivisionError())]
    assert [lost_gateway(e) for e in lost] == [True] * len(lost)
    assert [lost_gateway(e) for e in own] == [False] * len(own)


def test_an_unknown_path_is_a_json_404_naming_it_and_what_is_served(http):
    """An agent written against an API the gateway does not serve is told so at once, in OpenAI's error shape."""
    import openai

    from services.gateway.app import SERVED

    for method in ("POST", "GET", "DELETE"):
        r = http.request(method, "/ep/g-0/v1/nonexistent", json={})
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "unknown_url" and error["type"] == "invalid_request_error"
        assert f"{method} /ep/g-0/v1/nonexistent" in error["message"]
        assert all(f"{m} {p}" in error["message"] for m, p in SERVED)
        assert "/v1/responses" in error["message"] and "/v1/messages" in error["message"]
    # a served path asked with another method
    r = http.get("/ep/g-0/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.json()["error"]["message"]
    # outside /ep/
    r = http.post("/v2/whatever")
    assert r.status_code == 404 and "POST /v2/whatever" in r.json()["error"]["message"]
    # a stock client raises NotFoundError with the gateway's message
    oai = openai.OpenAI(base_url="http://testserver/ep/g-0/v1", api_key="x", http_client=http, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no such API"):
        oai.post("/nonexistent", body={}, cast_to=object)


def test_the_gateways_stopping_answer_and_errors_inside_exception_groups_are_told():
    """A framework's task group wraps the SDK's connection error in an ExceptionGroup: still the gateway's. The
    gateway's 503 ``gateway_stopping`` is the run's end (the runner cuts the episode short), another 503 is not."""
    import httpx
    import openai

    from services.gateway.runner import gateway_stopping, lost_gateway

    request = httpx.Request("POST", "http://127.0.0.1:1/ep/e/v1/chat/completions")
    grouped = ExceptionGroup("task group", [ValueError("other"), openai.APIConnectionError(request=request)])
    assert lost_gateway(grouped) and not lost_gateway(ExceptionGroup("task group", [ValueError("mine")]))

    def answer(body: dict) -> openai.APIStatusError:
        return openai.APIStatusError("x", response=httpx.Response(503, json=body, request=request), body=body)

    stopping = answer({"error": {"message": "the gateway is stopping", "code": "gateway_stopping"}})
    try:
        try:
            raise stopping
        except openai.APIStatusError as exc:
            raise RuntimeError("the framework's own error") from exc
    except RuntimeError as wrapped:
        assert gateway_stopping(wrapped)
    assert not gateway_stopping(answer({"error": {"message": "busy", "code": "overloaded"}}))


def test_the_prompt_renders_tools_and_messages_with_their_keys_in_the_order_the_client_sent(
    chat_dir, tok, client, keys
):
    """The chat template writes the tools as JSON: a model warm-started on one layout must see that layout, so
    the typed request (declared fields first) is not what is rendered; the body is."""
    from services.ops.launch.tiny_model import CHAT_TEMPLATE

    # the default model's template: it lists each tool as JSON
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT_TEMPLATE
    gw = Gateway(Config(run=keys.run, model_dir=chat_dir), client, tok, 400, ["chat"], logs.get("gateway-test"))
    start_agent_episode(client, keys, "g-order")
    user = [{"role": "user", "content": "hi"}]
    for tool in ({"type": "function", **CALC_TOOL}, {"function": CALC_TOOL["function"], "type": "function"}):
        gw.prepare_chat("g-order", {"messages": user, "tools": [tool], "max_tokens": 4})
        assert _request(client, keys, -1).prompt_ids == gw.renderer.full(user, [tool])
    first, second = (_request(client, keys, i).prompt_ids for i in (-2, -1))
    assert tok.decode(first).index('"type"') < tok.decode(first).index('"function"')
    assert tok.decode(second).index('"function"') < tok.decode(second).index('"type"')


def test_the_ask_ordinal_comes_with_the_call_already_requested_under_it(client, keys):
    asks, requester = Asks(client, keys), calls_codec.Requester(client, keys)
    assert asks.identity("o-0", "d", Ask()) == ("d:0", None)
    index, _ = requester.request(calls_codec.CallRequest("o-0", "d:0", -1, [1, 2], {"max_tokens": 4}))
    # a retry names the call the first ask made, found in the ordinal's own round trip
    assert asks.identity("o-0", "d", Ask(retry=True)) == ("d:0", index)
    assert asks.identity("o-0", "d", Ask()) == ("d:1", None)
    keyed, known = asks.identity("o-0", "d", Ask(idempotency_key="k-1"))
    assert known is None
    again, _ = requester.request(calls_codec.CallRequest("o-0", keyed, -1, [1, 2], {"max_tokens": 4}))
    assert asks.identity("o-0", "d", Ask(idempotency_key="k-1")) == (keyed, again) and again != index


def test_a_call_followed_on_from_what_the_request_read_is_the_streams_call(chat_dir, tok, client, keys):
    gw = Gateway(Config(run=keys.run, model_dir=chat_dir), client, tok, 160, ["chat"], logs.get("gateway-test"))
    start_agent_episode(client, keys, "f-0")
    before = gw._episode("f-0").events
    log = EpisodeLog(client, keys, "w")
    log.open("f-0", 1)
    call = {"call": 0, "extends": -1, "prompt_ids": [5, 6], "digest": "d:0", "sampling": {"max_tokens": 8}}
    log.append("f-0", "call", {**call, "messages": ""}, 0)
    log.append_tokens("f-0", [7, 8, 9], [-0.1, -0.2, -0.3], 0, None, call=0)
    log.flush_or_raise()
    # read while the call generates: the rest lands after it
    during = gw._episode("f-0").events
    log.append_tokens("f-0", [10, 11], [-0.4, -0.5], 0, None, call=0)
    log.append("f-0", "call_done", {"call": 0, "reason": "length", "num_tokens": 5}, 0)
    log.flush_or_raise()
    whole = gw.wait_done("f-0", 0)
    assert whole.tokens == [7, 8, 9, 10, 11] and whole.prompt_ids == [5, 6] and whole.done
    assert gw.wait_done("f-0", 0, before) == whole
    assert gw.wait_done("f-0", 0, during) == whole
    assert gw.wait_done("f-0", 0, gw._episode("f-0").events) == whole


def test_an_internal_error_is_a_json_500_in_the_shape_of_the_api_asked(chat_dir, tok, keys):
    # a Redis nobody serves: the episode cannot be read
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    gw = Gateway(Config(run=keys.run, model_dir=chat_dir), down, tok, 160, ["chat"], logs.get("gateway-test"))
    http = TestClient(make_app(gw))
    r = _post(http, {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "ConnectionError" in r.json()["error"]["message"] and "Traceback" not in r.text
    r = http.post(
        "/ep/g-0/v1/messages", json={"model": "chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
