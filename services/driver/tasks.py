"""Tasks: prompts with ground truth. The built-in one is integer arithmetic; a user's own comes from a
jsonl / json / parquet / csv file or a hub dataset (``datasets``), with text or chat-message prompts."""

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
        return [
            (f"<call>calc: {expr}</call>", True),
            (f"<result>{row['answer']}</result>", False),
            (row["answer"], True),
        ]
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
    raise ValueError(
        f"dataset {name!r}: expected one of {', '.join(BUILTIN)}, a .jsonl / .json / .parquet / .csv "
        f"file or a hub dataset name"
    )


FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_rows(
    source: str, split: str = "train", prompt_key: str = "prompt", answer_key: str = "answer", key: str = "dataset"
) -> list[dict]:
    """Rows of a .jsonl / .json / .parquet / .csv file or a hub dataset (``split``; the local cache when
    offline), read with the ``datasets`` library -> [{"prompt": text or chat messages, "answer", ...other columns}].
    ``key`` names the config key in errors."""
    import datasets

    kind = FILE_KINDS.get(Path(source).suffix.lower())
    where = f"config key {key!r}: {source}"
    datasets.disable_progress_bars()
    # its errors come back as one line below
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    try:
        if kind:
            if not Path(source).is_file():
                raise ValueError(f"{where}: no such file")
            ds = datasets.load_dataset(kind, data_files=str(source), split="train")
        else:
            ds = datasets.load_dataset(source, split=split)
    except ValueError as exc:
        if str(exc).startswith(where):
            raise
        raise ValueError(f"{where}: {_first_bad_line(source) or str(exc).splitlines()[0]}") from None
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (FileNotFound, connection, arrow): one line
        hint = (
            ""
            if kind
            else f" (not a built-in task ({', '.join(BUILTIN)}), not a file with a suffix in "
            f"{', '.join(FILE_KINDS)}, and not a hub dataset in the local cache)"
        )
        raise ValueError(f"{where}: {_first_bad_line(source) or str(exc).splitlines()[0]}{hint}") from None
    return [normalize_row(row, i, where, prompt_key, answer_key) for i, row in enumerate(ds.to_list())]


def _first_bad_line(path: str) -> str | None:
    """For a .jsonl file datasets could not read: the first line that is not JSON."""
    if Path(path).suffix != ".jsonl" or not Path(path).is_file():
        return None
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            line.strip() and json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {lineno}: not JSON ({exc.msg})"
    return None


def normalize_row(row: dict, i: int, where: str, prompt_key: str, answer_key: str) -> dict:
    """One dataset row as a task row. The prompt is ``row[prompt_key]`` (text or chat messages), else (only when
    ``prompt_key`` is the default ``prompt``) a ``messages`` column; chat messages that end with an assistant turn
    give it as the answer when the row has no ``answer_key`` (the reference reply), and the prompt is the turns
    before it."""
    from shared.runtime.prompt_format import PromptError, check_messages

    # only the default key falls back
    fallback = prompt_key == "prompt" and row.get("messages") is not None
    column = prompt_key if row.get(prompt_key) is not None else "messages" if fallback else None
    if column is None:
        raise ValueError(
            f"{where}: row {i}: missing field {prompt_key!r} (config key 'prompt_key'; columns: {', '.join(row)})"
        )
    prompt, answer = row[column], row.get(answer_key)
    if isinstance(prompt, list):
        try:
            prompt = [
                {k: v for k, v in m.items() if v is not None} for m in check_messages(prompt, f"{where}: row {i}")
            ]
        except PromptError as exc:
            raise ValueError(str(exc)) from None
        if prompt[-1]["role"] == "assistant":
            answer = prompt[-1].get("content") if answer is None else answer
            prompt = prompt[:-1]
        if not prompt:
            raise ValueError(f"{where}: row {i}: the chat messages hold no turn before the assistant's")
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: row {i}: field {column!r}: expected text or chat messages, got {type(prompt).__name__}"
        )
    if answer is None:
        raise ValueError(
            f"{where}: row {i}: missing field {answer_key!r} (config key 'answer_key'; columns: {', '.join(row)})"
        )
    rest = {k: v for k, v in row.items() if k not in (column, answer_key, "prompt", "answer")}
    return {**rest, "prompt": prompt, "answer": answer}


class RowOrder:
    """Which row the ``index``-th prompt group gets: epoch ``index // len(rows)``, each epoch a fresh
    permutation seeded by (seed, epoch) when ``shuffle``, else file order."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool):
        if not rows:
            raise ValueError("no training rows (the dataset is empty, or all of it was held out)")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self._epoch, self._perm = -1, list(range(len(rows)))

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> dict:
        epoch, i = divmod(index, len(self.rows))
        if self.shuffle and epoch != self._epoch:
            self._epoch, self._perm = (
                epoch,
                random.Random(f"{self.seed}:{epoch}").sample(range(len(self.rows)), len(self.rows)),
            )
        return self.rows[self._perm[i]]
