"""Built-in tasks, reference responses, user datasets (jsonl/parquet), and the warm-start examples."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from services.driver import tasks
from services.ops.launch.default_model import sft_examples
from services.ops.launch.tiny_model import build_tokenizer
from services.rollout.jobs.rewards import arithmetic as reward


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
    # most are short ...
    assert terms[2] > 0.35 * len(rows)
    # ... a few are long
    assert 0.02 * len(rows) < sum(n for k, n in terms.items() if k >= 12) < 0.2 * len(rows)


@pytest.mark.parametrize(
    "row, tools, parts",
    [
        ({"prompt": "3+4=", "answer": "7"}, False, [("7", True)]),
        ({"prompt": "3+4+9+1=", "answer": "17"}, False, [("7,16,17", True)]),
        (
            {"prompt": "3+4=", "answer": "7"},
            True,
            [("<call>calc: 3+4</call>", True), ("<result>7</result>", False), ("7", True)],
        ),
    ],
)
def test_reference_responses_earn_the_reward(row, tools, parts):
    assert tasks.reference(row, tools=tools) == parts
    assert reward("".join(text for text, _ in parts), row)[0] == 1.0


def test_builtin_names_and_unknown_name():
    assert tasks.builtin("chain_sum", 5, seed=2) == tasks.chain_sum(5, seed=2)
    with pytest.raises(ValueError, match="dataset 'nope': expected one of arithmetic, chain_sum"):
        tasks.builtin("nope", 1)


def test_load_jsonl_parquet_and_csv_keep_answer_types(tmp_path):
    rows = [{"prompt": "2+2=", "answer": 4, "level": "easy"}, {"prompt": "5+1=", "answer": 6, "level": None}]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = tasks.load_rows(str(path))
    assert got == [{"prompt": "2+2=", "answer": 4, "level": "easy"}, {"prompt": "5+1=", "answer": 6, "level": None}]
    # a dependency: parquet datasets work on a fresh install
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "truth": "2"}]), tmp_path / "mine.parquet")
    assert tasks.load_rows(str(tmp_path / "mine.parquet"), prompt_key="question", answer_key="truth") == [
        {"prompt": "1+1=", "answer": "2"}
    ]
    (tmp_path / "mine.csv").write_text("q,a\n3+3=,6\n")
    assert tasks.load_rows(str(tmp_path / "mine.csv"), prompt_key="q", answer_key="a") == [
        {"prompt": "3+3=", "answer": 6}
    ]


def test_chat_rows_from_messages(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"},
            ]
        },
        {"prompt": [{"role": "user", "content": "5+1="}], "answer": "6"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    got = tasks.load_rows(str(path))
    assert got[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    # the reference reply, when there is no answer column
    assert got[0]["answer"] == "4"
    assert got[1]["prompt"] == [{"role": "user", "content": "5+1="}] and got[1]["answer"] == "6"


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"prompt": "1+1="}\n', "row 0: missing field 'answer' \\(config key 'answer_key'"),
        ('{"question": "1+1=", "answer": "2"}\n', "row 0: missing field 'prompt' \\(config key 'prompt_key'"),
        ('{"prompt": "1+1=", "answer": "2"}\nnot json\n', "mine.jsonl: line 2: not JSON"),
        ('{"prompt": [{"content": "x"}], "answer": "2"}\n', "row 0: message 0: expected a map with a 'role'"),
    ],
)
def test_bad_dataset_rows_name_the_file_row_and_field(tmp_path, text, words):
    path = tmp_path / "mine.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match="config key 'dataset': .*" + words):
        tasks.load_rows(str(path))


def test_missing_file_and_uncached_hub_dataset_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="mine.parquet: no such file"):
        tasks.load_rows(str(tmp_path / "mine.parquet"))
    import datasets
    import huggingface_hub.constants

    # offline as a person sets it before the process starts: the libraries read these at import time, and an
    # earlier test may have imported them (the environment alone would leave a ~20 s network timeout here)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="config key 'eval_dataset': someone/nothing-here") as exc:
        tasks.load_rows("someone/nothing-here", key="eval_dataset")
    assert "\n" not in str(exc.value)


def test_row_order_shuffles_with_the_seed_and_reshuffles_each_epoch():
    rows = [{"prompt": str(i), "answer": i} for i in range(20)]
    order = tasks.RowOrder(rows, seed=3, shuffle=True)
    first = [order.row(i)["answer"] for i in range(20)]
    second = [order.row(i)["answer"] for i in range(20, 40)]
    # every row once per epoch
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != list(range(20)) and first != second
    assert first == [tasks.RowOrder(rows, seed=3, shuffle=True).row(i)["answer"] for i in range(20)]
    assert [tasks.RowOrder(rows, 3, shuffle=False).row(i)["answer"] for i in range(25)] == [*range(20), *range(5)]


def test_warm_start_examples_learn_only_what_the_policy_writes():
    tok = build_tokenizer()
    ((ids, labels),) = sft_examples([{"prompt": "3+4=", "answer": "7"}], tok, tools=True)
    text = tok.decode(ids)
    assert text == "3+4=<call>calc: 3+4</call><result>7</result>7<eos>"
    learned = tok.decode([i for i, l in zip(ids, labels) if l != -100])
    # not the prompt, not the tool's result
    assert learned == "<call>calc: 3+4</call>7<eos>"
    assert all(l in (-100, i) for i, l in zip(ids, labels))
