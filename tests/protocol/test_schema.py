"""The schema cannot drift: `streamrl schema` lists every key the code builds, as the builders make it;
the key catalog names every builder of ``Keys`` and every builder the code calls; the hand-written episode in
``events.py``'s docstring runs as written against a real server and replays."""

from __future__ import annotations

import fnmatch
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from services.ops.launch.redis_server import find_binary
from shared.protocol import schema
from shared.protocol.episode import events
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import CATALOG, PREFIX, Keys

ROOT = Path(__file__).resolve().parents[2]
NOT_KEYS = {"episode_id", "is_episode", "alive_name", "alive_pattern", "patterns", "run", "base", "episode_prefix"}


def _builders() -> set[str]:
    """Every public member of Keys that builds a key (helpers that parse keys or make SCAN patterns excluded)."""
    return {name for name, _ in inspect.getmembers(Keys) if not name.startswith("_")} - NOT_KEYS


def test_the_catalog_names_every_builder_of_keys_once():
    named = [row[0] for row in CATALOG]
    assert len(named) == len(set(named))
    assert set(named) == _builders(), set(named) ^ _builders()


def test_every_builder_the_code_calls_is_in_the_catalog():
    called = set()
    for folder in ("services", "shared"):
        for path in (ROOT / folder).rglob("*.py"):
            called |= set(re.findall(r"\bkeys\.([a-z_]+)\b", path.read_text()))
    # "keys.py" in comments
    unknown = called - {row[0] for row in CATALOG} - NOT_KEYS - {"py"}
    assert not unknown, f"keys built in the code but missing from keys.CATALOG: {sorted(unknown)}"


def test_every_key_of_a_run_matches_the_runs_scan_patterns_with_its_hash_tags():
    keys = Keys("demo")
    table = schema.key_table("demo")
    for key, builder, kind, _, _ in table:
        if kind == "rq queue":
            assert key.endswith("-demo"), key
            continue
        assert any(fnmatch.fnmatchcase(key, p) for p in keys.patterns), key
        assert key.startswith(keys.base) or key.startswith(keys.episode_prefix), key
    # the hash tags
    assert keys.base.endswith("{demo}:") and keys.episode("e1").endswith(":ep:{e1}")


def test_streamrl_schema_prints_every_key_as_built(cli_env):
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "schema"],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    for key, builder, *_ in schema.key_table():
        assert f"| `{key}` | `{builder}` |" in out.stdout
    # the old, wrong rule
    assert f"{PREFIX}:<run>:<name>" not in out.stdout


def _docstring_commands() -> list[str]:
    """The shell commands of events.py's "Writing an episode by hand", continuation lines joined."""
    text = events.__doc__.split("Writing an episode by hand")[1]
    lines = [line.strip() for line in text.strip().splitlines()]
    commands, current = [], ""
    for line in lines:
        current += line.removesuffix("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    return [c for c in commands if c.startswith(("python ", "streamrl "))]


def test_the_hand_written_episode_in_the_docstring_runs_and_replays(redis_server, client, keys, cli_env):
    commands = _docstring_commands()
    assert len(commands) == 4 and commands[-1] == "streamrl replay e1 --run demo"
    server = Path(find_binary())
    cli = next(p for p in (server.with_name("valkey-cli"), server.with_name("redis-cli")) if p.exists())
    for command in commands[:-1]:
        shell = (
            command.replace("python -c", f"{sys.executable} -c")
            .replace("redis-cli -x", f"{cli} -p {redis_server.port} -x")
            .replace(Keys("demo").episode_prefix, keys.episode_prefix)
        )
        done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "ERR" not in done.stdout, (shell, done.stdout, done.stderr)
    # read back through the codec
    ep = fold(EpisodeLog(client, keys, "reader").read("e1"))
    assert (ep.prompt_ids, ep.tokens, ep.status, ep.reward) == ([20, 21, 22], [30, 31], "finished", 1.0)
    replay = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.ops.cli.main",
            *commands[-1].split()[1:-1],
            keys.run,
            # no model needed: the default one may not be made on this machine
            "--no-text",
        ],
        env={**cli_env, **os.environ, "REDIS_URL": redis_server.url},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert replay.returncode == 0 and "finished" in replay.stdout, replay.stdout + replay.stderr
