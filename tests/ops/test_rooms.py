"""A folder is a room: every package says in its ``__init__`` docstring what it holds, and flat modules that share
a name prefix (``segment_*``, ``check_*``) are a room that wants its own sub-package."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services")
# three modules with one prefix is a room; two (``starter``/``starter_client``) can still be a module and its client
MAX_SHARED_PREFIX = 2


def packages(root: Path) -> list[Path]:
    return sorted(p.parent for top in PACKAGES for p in (root / top).rglob("__init__.py"))


def undocumented(root: Path) -> list[str]:
    out = []
    for pkg in packages(root):
        init = pkg / "__init__.py"
        if not ast.get_docstring(ast.parse(init.read_text())):
            out.append(str(init.relative_to(root)))
    return out


def crowded(root: Path) -> list[str]:
    out = []
    for pkg in packages(root):
        names = [p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")]
        prefixes = Counter(n.split("_")[0] for n in names if "_" in n)
        for prefix, n in prefixes.items():
            # a module named for the prefix itself (``segments`` beside ``segment_*``) belongs to the same room
            n += sum(1 for name in names if name in (prefix, prefix + "s"))
            if n > MAX_SHARED_PREFIX:
                out.append(f"{pkg.relative_to(root)}: {n} modules named {prefix}_*")
    return out


def test_every_package_says_what_its_room_holds():
    assert undocumented(ROOT) == []


def test_no_package_holds_a_room_of_flat_files():
    assert crowded(ROOT) == []


def test_the_rules_catch_a_flat_room_and_a_silent_package(tmp_path):
    pkg = tmp_path / "shared" / "protocol"
    pkg.mkdir(parents=True)
    (tmp_path / "shared" / "__init__.py").write_text('"""Shared."""\n')
    (pkg / "__init__.py").write_text("")
    for name in ("segments", "segment_index", "segment_builder", "keys"):
        (pkg / f"{name}.py").write_text("")
    (tmp_path / "services").mkdir()
    assert undocumented(tmp_path) == ["shared/protocol/__init__.py"]
    assert crowded(tmp_path) == ["shared/protocol: 3 modules named segment_*"]
