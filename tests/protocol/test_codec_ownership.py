"""One owner per stream and per name, checked on the source of services/, shared/, tests/ and bench/:

- no stream entry decoded by hand outside its codec (a field read by its bytes name, ``f[b"version"]``,
  ``fields.get(b"group_id")``, outside ``shared/protocol/``);
- no consumer-group name typed as a literal where a command takes one (``keys.ROLLOUT_GROUP`` / ``TRAINER_GROUP``);
- no key built by hand (an f-string or literal starting ``streamrl:``) outside ``shared/protocol/keys.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("services", "shared", "tests", "bench")
# (command, position of its consumer-group argument)
GROUP_ARG = {
    "xreadgroup": 0,
    "xpending": 1,
    "xpending_range": 1,
    "xgroup_create": 1,
    "xgroup_setid": 1,
    "xinfo_consumers": 1,
    "xack": 1,
    "xclaim": 1,
    "xautoclaim": 1,
    "xgroup_destroy": 1,
}


def _files():
    for folder in FOLDERS:
        yield from (p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__).resolve())


def _problems(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    in_protocol = rel.startswith("shared/protocol/")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if not in_protocol:
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, bytes)
            ):
                out.append(f"{rel}:{node.lineno}: field {node.slice.value!r} read by hand (use the stream's codec)")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, bytes)
            ):
                out.append(f"{rel}:{node.lineno}: field {node.args[0].value!r} read by hand (use the stream's codec)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_ARG:
            i = GROUP_ARG[node.func.attr]
            if len(node.args) > i and isinstance(node.args[i], ast.Constant) and isinstance(node.args[i].value, str):
                out.append(
                    f"{rel}:{node.lineno}: consumer group {node.args[i].value!r} typed as a literal "
                    f"(use shared.protocol.keys)"
                )
        if rel != "shared/protocol/keys.py":
            # (an f-string's text parts included)
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and text.startswith("streamrl:") and " " not in text:
                out.append(f"{rel}:{node.lineno}: key {text!r} built by hand (use shared.protocol.keys.Keys)")
    return out


def test_entries_decoded_keys_built_and_groups_named_only_by_their_owner():
    problems = [p for path in _files() for p in _problems(path)]
    assert not problems, "\n".join(problems)


def test_the_check_sees_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'v = f[b"version"]\ng = fields.get(b"group_id")\nc.xpending(k, "rollout")\nkey = f"streamrl:{r}:x"\n'
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        # and a corrupting write (f[b"type"] = ...) in a test is not a read
        assert len(_problems(bad)) == 4
    finally:
        ROOT = saved
