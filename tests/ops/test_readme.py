"""The README's Layout table names real files (each `x.py` in a row exists under that row's folder)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layout_table_names_real_files():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout"):]
    missing = []
    for row in re.findall(r"^\| `([^`]+)`[^|]*\| (.*) \|$", table, flags=re.M):
        folder, what = ROOT / row[0].split("`")[0], row[1]
        if not folder.exists():
            missing.append(row[0])
            continue
        for name in re.findall(r"`([\w/]+\.py)`", what):
            if not (folder / name).exists() and not any(folder.rglob(name)):
                missing.append(f"{row[0]}{name}")
    assert not missing, f"README Layout names files that do not exist: {missing}"
