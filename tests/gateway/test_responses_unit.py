"""Responses input items as chat messages: what an answer's output items map back to (chat.find_parent compares
them with the answer ``Gateway.answer`` gave), pure functions."""

from __future__ import annotations

import pytest

from services.gateway.apis.responses import messages_of
from services.gateway.chat import canonical
from services.gateway.errors import GatewayError


def _call(item_id: str | None, call_id: str, expr: str) -> dict:
    item = {"type": "function_call", "call_id": call_id, "name": "calc", "arguments": f'{{"e": "{expr}"}}'}
    return {**item, "id": item_id} if item_id else item


def _said(item_id: str | None, text: str) -> dict:
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    return {**item, "id": item_id} if item_id else item


def test_an_answers_message_and_function_calls_are_one_assistant_message():
    answer = {
        "role": "assistant",
        "content": "let me see",
        "tool_calls": [
            {"id": f"call_3_{k}", "type": "function", "function": {"name": "calc", "arguments": f'{{"e": "{e}"}}'}}
            for k, e in enumerate(["1+1", "2+2"])
        ],
    }
    items = [
        {"role": "user", "content": "hi"},
        _said("msg_3_ab", "let me see"),
        _call("fc_3_ab_0", "call_3_0", "1+1"),
        _call("fc_3_ab_1", "call_3_1", "2+2"),
        {"type": "function_call_output", "call_id": "call_3_0", "output": [{"type": "input_text", "text": "2"}]},
    ]
    got = messages_of(items)
    assert [canonical(m) for m in got[:2]] == [canonical({"role": "user", "content": "hi"}), canonical(answer)]
    assert got[2] == {"role": "tool", "tool_call_id": "call_3_0", "content": "2"}


def test_function_calls_of_another_response_are_a_turn_of_their_own():
    # a text answer (call 1), then an answer of tool calls only (call 2): two assistant messages, as answered
    got = messages_of([{"role": "user", "content": "hi"}, _said("msg_1_ab", "ok"), _call("fc_2_cd_0", "c", "1")])
    assert [m["role"] for m in got] == ["user", "assistant", "assistant"] and "tool_calls" not in got[1]
    # no ids (a client's own history): adjacent items are one turn, as OpenAI reads them
    got = messages_of([{"role": "user", "content": "hi"}, _said(None, "ok"), _call(None, "c", "1")])
    assert [m["role"] for m in got] == ["user", "assistant"] and got[1]["tool_calls"][0]["id"] == "c"


def test_developer_is_system_and_a_bad_item_is_named():
    assert messages_of([{"role": "developer", "content": "be brief"}]) == [{"role": "system", "content": "be brief"}]
    with pytest.raises(GatewayError) as err:
        messages_of([{"role": "user", "content": "hi"}, "text"])
    assert err.value.param == "input[1]" and err.value.status == 400
