"""bench/headline.py: result files in, the RESULTS.md headline table out; a row whose measured code changed since
its commit is marked stale, a moved file is not a change."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

# moves with tests/
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
_spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "bench" / "headline.py")
headline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headline)

HEADLINES = [("a", "figure a", "python bench/a.py"), ("b", "figure b", "python bench/b.py --x")]


def result(**kw) -> dict:
    base = {
        "name": "a",
        "command": "python bench/a.py",
        "date": "2026-11-25 09:00 UTC",
        "commit": "abc1234def",
        "dirty": False,
        "machine": "2 CPUs (EPYC), no GPU",
        "quick": False,
        "simulated": "",
        "measures": ["services/rollout"],
        "rows": [{"what": "overhead", "value": "0.95x"}],
    }
    return {**base, **kw}


def test_fresh_row_and_missing_benchmark():
    out = headline.table({"a": result()}, changed=lambda c, p: 0, headlines=HEADLINES)
    lines = out.splitlines()
    assert lines[0].startswith("| what | figure | command |")
    assert lines[2] == (
        "| figure a | **0.95x** (overhead) | `python bench/a.py` | 2026-11-25, `abc1234` | 2 CPUs (EPYC), no GPU |"
    )
    two = headline.table(
        {"a": result(rows=[{"what": "x", "value": "1"}, {"what": "y", "value": "2"}])},
        changed=lambda c, p: 0,
        headlines=HEADLINES,
    )
    assert "| figure a | x: **1**<br>y: **2** |" in two
    assert lines[3] == "| figure b | not measured yet | `python bench/b.py --x` | | |"


def test_stale_rows_are_marked():
    changed = {"abc1234def": 12, "gone": None}
    out = headline.table(
        {"a": result(), "b": result(name="b", commit="gone")}, changed=lambda c, p: changed[c], headlines=HEADLINES
    )
    assert "| **STALE: 12 lines of services/rollout changed since abc1234**<br>~~**0.95x** (overhead)~~ |" in out
    assert "STALE: commit gone is not in this history" in out
    dirty = headline.table({"a": result(dirty=True)}, changed=lambda c, p: 0, headlines=HEADLINES)
    assert "STALE: ran with uncommitted changes" in dirty


def test_quick_and_simulated_are_said_in_the_row():
    out = headline.table(
        {"a": result(quick=True, simulated="every engine step sleeps 20 ms")},
        changed=lambda c, p: 0,
        headlines=HEADLINES,
    )
    assert "| figure a (quick run; SIMULATED: every engine step sleeps 20 ms) | **0.95x** (overhead) |" in out


def test_rewrite_touches_only_the_block():
    text = f"# Benchmarks\n\n{headline.START}\nold table\n{headline.END}\n\n## History\nkept | as is\n"
    new = headline.rewrite(text, "new table")
    assert new == f"# Benchmarks\n\n{headline.START}\nnew table\n{headline.END}\n\n## History\nkept | as is\n"
    assert headline.rewrite(new, "new table") == new
    fresh = headline.rewrite("# Benchmarks\n\n## History\n", "t")
    assert fresh == f"# Benchmarks\n\n{headline.START}\nt\n{headline.END}\n\n## History\n"
    with pytest.raises(ValueError):
        headline.rewrite(f"# B\n{headline.START}\n", "t")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def test_changed_lines_ignores_moves_and_imports_but_not_edits(tmp_path):
    git(tmp_path, "init", "-q")
    pkg = tmp_path / "services" / "rollout"
    pkg.mkdir(parents=True)
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(20))
    (pkg / "puller.py").write_text("from services.rollout.weights import load\n\n" + body)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    measured = git(tmp_path, "rev-parse", "HEAD")
    (pkg / "weights").mkdir()
    git(tmp_path, "mv", "services/rollout/puller.py", "services/rollout/weights/puller.py")
    moved = pkg / "weights" / "puller.py"
    # the import follows the move
    text = moved.read_text().replace("weights import", "weights.load import")
    moved.write_text(text + "# a comment\n")
    git(tmp_path, "commit", "-qam", "move")
    assert headline.changed_lines(measured, ["services/rollout"], tmp_path) == 0
    moved.write_text(moved.read_text().replace("return x + 3", "return x + 4"))
    git(tmp_path, "commit", "-qam", "edit")
    assert headline.changed_lines(measured, ["services/rollout"], tmp_path) == 2
    assert headline.changed_lines("0" * 40, ["services/rollout"], tmp_path) is None


def test_an_in_process_benchmark_measures_the_files_it_imported():
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import services.trainer.batch; from bench.record import loaded; print('\\n'.join(loaded()))",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = out.split()
    assert "services/trainer/batch.py" in files and "shared/protocol/episode/fold.py" in files
    # never imported: a change there leaves the figures current
    assert "services/trainer/trainer.py" not in files
    assert all(f.startswith(("services/", "shared/")) and f.endswith(".py") for f in files)
