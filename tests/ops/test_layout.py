"""The layout rule, checked on the source: ``shared/`` imports nothing from ``services/``; no service
imports a sibling service; only ``services/ops/`` (the composition root: the CLI) imports them all."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from services import rollout`
            if node.module in ("services", "shared"):
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return names


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "shared").rglob("*.py")):
        for name in imported_modules(path):
            if name == "services" or name.startswith("services."):
                found.append(f"{path.relative_to(root)} imports {name} (shared/ must not import services/)")
    for path in sorted((root / "services").rglob("*.py")):
        parts = path.relative_to(root / "services").parts
        if len(parts) < 2:
            continue
        own = parts[0]
        if own == "ops":
            continue
        for name in imported_modules(path):
            bits = name.split(".")
            if bits[0] == "services" and len(bits) > 1 and bits[1] != own:
                found.append(f"{path.relative_to(root)} imports {name} (a service imports no sibling service)")
    return found


def test_shared_imports_no_service_and_services_import_no_sibling():
    assert violations(ROOT) == []


def test_rule_catches_a_violation(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "services" / "trainer").mkdir(parents=True)
    (tmp_path / "services" / "ops").mkdir(parents=True)
    (tmp_path / "shared" / "x.py").write_text("from services.rollout import worker\n")
    (tmp_path / "services" / "trainer" / "t.py").write_text(
        "import services.syncer.syncer\nfrom services.trainer import loss\n"
    )
    (tmp_path / "services" / "ops" / "cli.py").write_text("from services.trainer import trainer\n")
    found = violations(tmp_path)
    assert len(found) == 2
    assert "shared/x.py imports services.rollout" in found[0] and "services/trainer/t.py" in found[1]
