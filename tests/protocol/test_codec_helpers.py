"""The stream codecs' shared helpers (shared/protocol/streams/codec.py), on a real server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import redis

from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import codec

ROOT = Path(__file__).resolve().parents[2]


def test_text_and_integer():
    assert codec.text(b"abc") == "abc"
    assert codec.text("abc") == "abc"
    assert codec.text(7) == "7"
    assert codec.text(b"a\xffb") == "a\ufffdb"
    assert codec.integer(b"12") == 12 and codec.integer("-3") == -3
    with pytest.raises(ValueError, match="'x1'"):
        codec.integer(b"x1")


def test_ensure_group_creates_once_and_keeps_the_cursor(client, keys):
    stream = keys.prompts + ":codec-test"
    assert codec.ensure_group(client, stream, ROLLOUT_GROUP) is True
    client.xadd(stream, {"a": "1"})
    assert client.xreadgroup(ROLLOUT_GROUP, "c1", {stream: ">"}, count=10)
    # a second process starting finds the group and its cursor as they were: nothing delivered twice
    assert codec.ensure_group(client, stream, ROLLOUT_GROUP) is False
    assert client.xreadgroup(ROLLOUT_GROUP, "c2", {stream: ">"}, count=10) == []
    client.delete(stream)


def test_ensure_group_raises_what_is_not_an_existing_group(client, keys):
    key = keys.prompts + ":codec-not-a-stream"
    client.set(key, "plain string")
    with pytest.raises(redis.exceptions.ResponseError):
        codec.ensure_group(client, key, ROLLOUT_GROUP)
    client.delete(key)


# ---- written once: no module keeps its own copy


def _is_text_helper(fn: ast.FunctionDef) -> bool:
    """``return v.decode(...) if isinstance(v, bytes) else str(v)`` (UTF-8: a latin-1 byte round trip is another
    thing)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.IfExp):
        return False
    expr = body[0].value
    test, decode = expr.test, expr.body
    return (
        isinstance(test, ast.Call)
        and getattr(test.func, "id", "") == "isinstance"
        and getattr(test.args[1], "id", "") == "bytes"
        and isinstance(decode, ast.Call)
        and getattr(decode.func, "attr", "") == "decode"
        and "latin-1" not in ast.unparse(decode)
    )


def copies(root: Path) -> list[str]:
    found = []
    for top in ("shared", "services", "tests", "bench"):
        for path in sorted((root / top).rglob("*.py")):
            if path == root / "shared" / "protocol" / "streams" / "codec.py":
                continue
            source = path.read_text()
            rel = path.relative_to(root)
            if "BUSYGROUP" in source and path.name != "test_codec_helpers.py":
                found.append(f"{rel}: its own BUSYGROUP handling (codec.ensure_group)")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef) and _is_text_helper(node):
                    found.append(f"{rel}: {node.name} is codec.text")
    return found


def test_each_helper_is_written_once():
    assert copies(ROOT) == []


def test_the_copy_check_catches_a_new_copy(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "x.py").write_text(
        "def _s(v):\n    return v.decode(errors='replace') if isinstance(v, bytes) else str(v)\n"
        "def _latin(v):\n    return v.decode('latin-1') if isinstance(v, bytes) else str(v)\n"
        "try:\n    pass\nexcept Exception as exc:\n    ok = 'BUSYGROUP' in str(exc)\n"
    )
    (tmp_path / "shared" / "y.py").write_text('BUSY = "BUSYGROUP"\n')
    assert copies(tmp_path) == [
        "shared/x.py: its own BUSYGROUP handling (codec.ensure_group)",
        "shared/x.py: _s is codec.text",
        "shared/y.py: its own BUSYGROUP handling (codec.ensure_group)",
    ]
