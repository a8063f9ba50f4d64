"""Tasks: prompts with ground truth. The built-in one is integer arithmetic;
a user's own comes from a jsonl or parquet file with prompt and answer fields."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path


def arithmetic(n: int, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict]:
    """``n`` problems like ``3+4=`` with their answers. Small on purpose: the
    default tiny model learns it on a CPU in minutes."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(answer)})
    return out


def chain_sum(n: int, seed: int = 0, max_terms: int = 24, tail: float = 1.5) -> list[dict]:
    """``n`` sums of 2..``max_terms`` one-digit numbers like ``3+4+5=``, answer ``12``. The number of terms
    is long-tailed (P(k) ∝ (k-1)^-``tail``): most prompts have 2 or 3 terms, a few have many, and the
    reference response writes every running sum (``7,12``), so response lengths are long-tailed too.
    The asynchronous-vs-synchronous benchmark uses it."""
    rng = random.Random(seed)
    ks = list(range(2, max_terms + 1))
    weights = [(k - 1) ** -tail for k in ks]
    out = []
    for _ in range(n):
        terms = [rng.randint(0, 9) for _ in range(rng.choices(ks, weights)[0])]
        out.append({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))})
    return out


def reference(row: dict, tools: bool = False) -> list[tuple[str, bool]]:
    """The reference response to a built-in task row, as (text, written by the model?) parts, for the
    warm start. A chain sum writes its running sums; with ``tools`` the model calls ``calc`` on the
    prompt's expression, the worker inserts ``<result>...</result>`` (not the model's), then the model
    writes the answer."""
    expr = row["prompt"].removesuffix("=")
    terms = re.findall(r"-?\d+|[-+*]", expr)
    if tools:
        return [(f"<call>calc: {expr}</call>", True), (f"<result>{row['answer']}</result>", False),
                (row["answer"], True)]
    if len(terms) > 3 and all(t == "+" for t in terms[1::2]):
        total, sums = int(terms[0]), []
        for t in terms[2::2]:
            total += int(t)
            sums.append(str(total))
        return [(",".join(sums), True)]
    return [(row["answer"], True)]


BUILTIN = ("arithmetic", "chain_sum")


def builtin(name: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of the built-in task ``name`` (one of :data:`BUILTIN`)."""
    if name == "arithmetic":
        return arithmetic(n, seed=seed)
    if name == "chain_sum":
        return chain_sum(n, seed=seed)
    raise ValueError(f"dataset {name!r}: expected one of {', '.join(BUILTIN)} or a .jsonl / .parquet file")


def load_file(path: str, prompt_field: str = "prompt", answer_field: str = "answer") -> list[dict]:
    """Rows of a .jsonl or .parquet file -> [{"prompt", "answer", ...other fields}]."""
    p = Path(path)
    if p.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
    elif p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(p).to_pylist()
    else:
        raise ValueError(f"{path}: expected a .jsonl or .parquet file")
    out = []
    for i, row in enumerate(rows):
        for field in (prompt_field, answer_field):
            if field not in row:
                raise ValueError(f"{path}: row {i}: missing field {field!r}")
        out.append({**row, "prompt": str(row[prompt_field]), "answer": str(row[answer_field])})
    return out
