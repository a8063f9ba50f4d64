"""bench/harness/headline.py: result files in, the RESULTS.md headline table out; a row whose measured code changed
since its commit is marked stale, a moved file is not a change."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

# moves with tests/
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
_spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "bench" / "harness" / "headline.py")
headline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headline)

HEADLINES = [("a", "figure a", "python bench/a.py", "page_a"), ("b", "figure b", "python bench/b.py --x", "page_b")]


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
    out = headline.table({"a": result()}, changed=lambda c, p: 0, headlines=HEADLINES, off={})
    lines = out.splitlines()
    assert lines[0] == "| what | figure | ran | history |"
    assert lines[2] == "| figure a | **0.95x** | 2026-11-25, `abc1234` | [page_a](history/page_a.md) |"
    assert lines[3] == "| figure b | not measured yet: `python bench/b.py --x` | | [page_b](history/page_b.md) |"


def test_cells_are_short_the_figure_and_its_ratio():
    long = (
        "median 22 ms, worst 44 ms of 5 queries x 5; folding every stream instead: 5.2 s (236x), and "
        + "more words " * 40
    )
    rows = [{"what": "x", "value": long}, {"what": "y", "value": "2"}]
    out = headline.table({"a": result(rows=rows)}, changed=lambda c, p: 0, headlines=HEADLINES, off={})
    row = out.splitlines()[2]
    assert "| **median 22 ms, worst 44 ms of 5 queries x 5 (236x)** |" in row
    # the second figure and the long tail live on the history page, not in the table
    assert "folding" not in row and "y" not in row.split("|")[2]
    assert max(len(cell) for cell in row.split("|")) < 100
    assert headline.short("1.58x (1,126 vs 712); greedy eval +0.045 vs sync") == "1.58x"
    assert headline.short("130 ms (replay 3.1 ms + re-prefill 127 ms) vs 6.2 s to generate: 47x") == "130 ms (47x)"
    assert headline.short("**635, 510 vs never, never**") == "635, 510 vs never, never"
    assert headline.short("word " * 40).endswith(" ...") and len(headline.short("word " * 40)) <= headline.SHORT + 4


def test_stale_rows_are_marked():
    changed = {"abc1234def": 12, "gone": None}
    out = headline.table(
        {"a": result(), "b": result(name="b", commit="gone")},
        changed=lambda c, p: changed[c],
        headlines=HEADLINES,
        off={},
    )
    assert "| figure a | **STALE** since `abc1234`: ~~**0.95x**~~ |" in out
    assert "| figure b | **STALE** since `gone`: ~~**0.95x**~~ |" in out
    assert headline.staleness(result(), lambda c, p: 12) == "STALE: 12 lines of services/rollout changed since abc1234"
    assert headline.staleness(result(commit="gone"), lambda c, p: None) == "STALE: commit gone is not in this history"
    assert "uncommitted" in headline.staleness(result(dirty=True), lambda c, p: 0)


def test_rows_kept_off_the_table_are_listed_under_it_with_why():
    out = headline.table(
        {"a": result(), "c": result(name="c")}, changed=lambda c, p: 0, headlines=HEADLINES, off={"a": "takes 3 hours"}
    )
    assert "| figure a |" not in out
    assert "| c: overhead | **0.95x** |" in out
    # a headline kept off links the page its row names, not a page named after the result
    assert out.splitlines()[-1] == "Kept off the table: `a` (takes 3 hours, see [its history](history/page_a.md))."


def test_the_real_table_keeps_stale_rows_off_and_links_pages_that_exist():
    out = headline.table(headline.load())
    assert "~~" not in out and "staleness (" not in out
    for page in set(headline.re.findall(r"\(history/([\w-]+)\.md\)", out)):
        assert (ROOT / "bench" / "history" / f"{page}.md").exists(), page


def test_quick_and_simulated_are_said_in_the_row():
    out = headline.table(
        {"a": result(quick=True, simulated="every engine step sleeps 20 ms")},
        changed=lambda c, p: 0,
        headlines=HEADLINES,
        off={},
    )
    assert "| figure a (quick run; SIMULATED) | **0.95x** |" in out


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


def test_a_script_moved_into_a_room_is_not_a_change(tmp_path):
    """The recorded paths are the old ones: the check follows the rename, and the lines the move itself rewrites
    (the script's own path in its usage text, a sibling's module name, where it finds the repository root, the
    docstring) do not count; a real edit still does."""
    git(tmp_path, "init", "-q")
    bench = tmp_path / "bench"
    bench.mkdir()
    script = (
        '"""Usage: python bench/x.py"""\nfrom pathlib import Path\n'
        "ROOT = Path(__file__).resolve().parent.parent\n"
        'USAGE = "python bench/x.py --help"\nCELL = "bench.x_cell"\n\n\ndef run(n):\n    return n * 2\n'
        + "".join(f"\n\ndef f{i}(x):\n    return x + {i}\n" for i in range(20))
    )
    (bench / "x.py").write_text(script)
    (bench / "x_cell.py").write_text("def cell(n):\n    return n + 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    measured = git(tmp_path, "rev-parse", "HEAD")
    (bench / "room").mkdir()
    git(tmp_path, "mv", "bench/x.py", "bench/room/x.py")
    git(tmp_path, "mv", "bench/x_cell.py", "bench/room/x_cell.py")
    (bench / "room" / "__init__.py").write_text('"""What the room is for."""\n')
    moved = bench / "room" / "x.py"
    moved.write_text(
        script.replace("bench/x.py", "bench/room/x.py")
        .replace("bench.x_cell", "bench.room.x_cell")
        .replace(".parent.parent", ".parents[2]")
        .replace('"""Usage', '"""Now run as: usage')
    )
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "rooms")
    paths = ["bench/x.py", "bench/x_cell.py"]
    assert headline.changed_lines(measured, paths, tmp_path) == 0
    moved.write_text(moved.read_text().replace("n * 2", "n * 3"))
    git(tmp_path, "commit", "-qam", "edit")
    assert headline.changed_lines(measured, paths, tmp_path) == 2


def test_an_in_process_benchmark_measures_the_files_it_imported():
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import services.trainer.batch; from bench.harness.record import loaded; print('\\n'.join(loaded()))",
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
