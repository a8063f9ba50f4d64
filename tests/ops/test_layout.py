"""The layout rules, checked on the source: ``shared/`` imports nothing from ``services/``; no service
imports a sibling service; only ``services/ops/`` (the composition root: the CLI) imports them all; and no two
modules import each other, directly or through others."""

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


# ---- no import circles


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each module of shared/ and services/ -> the project modules it imports, at module level or inside a function
    (a function-level import that closes a circle is the same circle, only deferred)."""
    mods = {}
    for top in ("shared", "services"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            edges[name].update(t for t in targets if t in mods and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    assert circles(module_graph(ROOT)) == []


def test_circle_check_catches_a_deferred_circle(tmp_path):
    pkg = tmp_path / "shared" / "protocol"
    pkg.mkdir(parents=True)
    (tmp_path / "services").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from shared.protocol.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from shared.protocol import a\n")
    (pkg / "c.py").write_text("from shared.protocol import a\n")
    assert circles(module_graph(tmp_path)) == [["shared.protocol.a", "shared.protocol.b"]]
