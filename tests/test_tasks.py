"""Built-in tasks, reference responses, user datasets (jsonl/parquet), and the warm-start examples."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from services.rollout.rewards import arithmetic as reward
from services.driver import tasks
from services.ops.tiny_model import build_tokenizer, sft_examples


def test_arithmetic_rows_are_right():
    rows = tasks.arithmetic(200, seed=3, max_operand=19, ops="+-*")
    for row in rows:
        assert str(eval(row["prompt"].removesuffix("="))) == row["answer"]
    assert len({r["prompt"] for r in rows}) > 100


def test_chain_sum_is_right_and_long_tailed():
    rows = tasks.chain_sum(3000, seed=1)
    terms = Counter(r["prompt"].count("+") + 1 for r in rows)
    for row in rows[:200]:
        assert str(sum(int(t) for t in row["prompt"].removesuffix("=").split("+"))) == row["answer"]
    assert min(terms) == 2 and max(terms) >= 20
    assert terms[2] > 0.35 * len(rows)  # most are short ...
    assert 0.02 * len(rows) < sum(n for k, n in terms.items() if k >= 12) < 0.2 * len(rows)  # ... a few are long


@pytest.mark.parametrize("row, tools, parts", [
    ({"prompt": "3+4=", "answer": "7"}, False, [("7", True)]),
    ({"prompt": "3+4+9+1=", "answer": "17"}, False, [("7,16,17", True)]),
    ({"prompt": "3+4=", "answer": "7"}, True, [("<call>calc: 3+4</call>", True), ("<result>7</result>", False),
                                             ("7", True)]),
])
def test_reference_responses_earn_the_reward(row, tools, parts):
    assert tasks.reference(row, tools=tools) == parts
    assert reward("".join(text for text, _ in parts), row)[0] == 1.0


def test_builtin_names_and_unknown_name():
    assert tasks.builtin("chain_sum", 5, seed=2) == tasks.chain_sum(5, seed=2)
    with pytest.raises(ValueError, match="dataset 'nope': expected one of arithmetic, chain_sum"):
        tasks.builtin("nope", 1)


def test_load_jsonl_and_parquet(tmp_path):
    rows = [{"prompt": "2+2=", "answer": 4, "level": "easy"}, {"prompt": "5+1=", "answer": "6"}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = tasks.load_file(str(path))
    assert got == [{"prompt": "2+2=", "answer": "4", "level": "easy"}, {"prompt": "5+1=", "answer": "6"}]
    import pyarrow as pa  # a dependency: parquet datasets work on a fresh install
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "truth": "2"}]), tmp_path / "mine.parquet")
    assert tasks.load_file(str(tmp_path / "mine.parquet"), "question", "truth")[0]["answer"] == "2"


@pytest.mark.parametrize("text, words", [
    ('{"prompt": "1+1="}\n', "row 0: missing field 'answer'"),
    ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', "mine.jsonl:2: not JSON"),
])
def test_bad_dataset_rows_name_the_file_row_and_field(tmp_path, text, words):
    path = tmp_path / "mine.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=words):
        tasks.load_file(str(path))
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet file"):
        tasks.load_file(str(tmp_path / "mine.csv"))


def test_warm_start_examples_learn_only_what_the_policy_writes():
    tok = build_tokenizer()
    (ids, labels), = sft_examples([{"prompt": "3+4=", "answer": "7"}], tok, tools=True)
    text = tok.decode(ids)
    assert text == "3+4=<call>calc: 3+4</call><result>7</result>7<eos>"
    learned = tok.decode([i for i, l in zip(ids, labels) if l != -100])
    assert learned == "<call>calc: 3+4</call>7<eos>"  # not the prompt, not the tool's result
    assert all(l in (-100, i) for i, l in zip(ids, labels))
