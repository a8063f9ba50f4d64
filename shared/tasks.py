"""Tasks: prompts with ground truth. The built-in one is integer arithmetic;
a user's own comes from a jsonl or parquet file with prompt and answer fields."""

from __future__ import annotations

import json
import random
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
