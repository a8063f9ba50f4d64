"""The README and docs/ stay true: the Layout table names real files, and every command a reader may copy from a
fenced code block of README.md or docs/*.md is one the code accepts.

Checked without running anything:
- `streamrl ...` (and `./dev run ...`, which is `streamrl run ...`): the real CLI's argument parser
  (`services.ops.cli.main.build_parser`) accepts the line, and its config flags (plus `STREAMRL_*=` assignments before
  it) pass the config's type and value checks;
- `python -m services.X ...` / `torchrun ... -m services.X -- ...`: the module's file exists, and each flag is a
  config key, `--config`, `--worker-id`, or named in the module's source;
- `python bench/X.py ...`: the script exists and each flag is named in its source or in a bench module it imports;
- `./dev X ...`: X is a subcommand of `./dev`; `./dev test PATH` (and `python -m pytest PATH`) names a path that
  exists;
- `pip install '.[extra]'`: the extra is in pyproject.toml; `honcho start -c NAME=N`: NAME is a Procfile process.
Placeholders are filled first: `[--flag V]` becomes `--flag V`, `<thing>` a value, an all-caps metavar (`N`,
`NAME`) `1`, and `...` is dropped. A command line is any line of a bash/sh block, or one starting with `$ `.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

# moves with tests/
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell"}
PYTHONS = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$")


def test_layout_table_names_real_files():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Layout") :]
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


# ---- finding the commands


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of every command in the text's fenced code blocks."""
    out, lang, block, start = [], None, [], 0
    for no, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and lang is None:
            lang, block, start = fence.group(1).lower(), [], no + 1
        elif fence:
            out += _commands_of_block(lang, block, start)
            lang = None
        elif lang is not None:
            block.append(line)
    return out


def _commands_of_block(lang: str, lines: list[str], start: int) -> list[tuple[int, str]]:
    out, current, first = [], None, 0
    for i, line in enumerate(lines):
        # a continuation of the line before
        if current is not None:
            current += " " + line.strip()
        else:
            stripped = line.strip()
            if stripped.startswith("$ "):
                current, first = stripped[2:], start + i
            elif lang in SHELL_LANGS and stripped and not stripped.startswith("#"):
                current, first = stripped, start + i
            else:
                continue
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        out.append((first, current))
        current = None
    return out


def segments(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at |, ;, &&), each as words, comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    words, out = [], []
    for tok in lex:
        if tok and set(tok) <= set(";&|"):
            out.append(words)
            words = []
        else:
            words.append(tok)
    return [w for w in [*out, words] if w]


def fill_placeholders(words: list[str]) -> list[str]:
    out = []
    for w in words:
        w = w.strip("[]") if w not in ("[", "]") else ""
        if not w or w == "...":
            continue
        if re.fullmatch(r"<[^>]+>", w) or re.fullmatch(r"[A-Z][A-Z_]*", w):
            w = "1"
        out.append(w)
    return out


# ---- checking one command


def _cli_parser():
    from services.ops.cli.main import build_parser

    return build_parser()


def _check_config(flags: dict, env: dict[str, str]) -> str:
    from shared.runtime.config import sources as config_sources
    from shared.runtime.config.errors import ConfigError

    try:
        config_sources.load_with_sources(None, env=env, overrides=flags)
    except ConfigError as exc:
        return f"config: {exc}"
    return ""


def check_streamrl(args: list[str], env: dict[str, str]) -> str:
    """ "" when `streamrl <args>` parses and its config values pass the checks, else why not."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = _cli_parser().parse_args(fill_placeholders(args))
    except SystemExit:
        return "the CLI's parser refuses it: " + err.getvalue().strip().splitlines()[-1]
    flags = {k.removeprefix("cfg_"): v for k, v in vars(ns).items() if k.startswith("cfg_") and v is not None}
    return _check_config(flags, env)


def _source_names_flag(paths: list[Path], flag: str) -> bool:
    return any(f'"{flag}"' in p.read_text() or f"'{flag}'" in p.read_text() for p in paths)


def _bench_sources(script: Path) -> list[Path]:
    """The script and the bench modules it imports (`from bench.room.x import`, `from bench.room import x`)."""
    src = script.read_text()
    names = re.findall(r"from bench\.(\w+)\.(\w+) import", src) + re.findall(r"from bench\.(\w+) import (\w+)", src)
    return [script, *(p for room, n in names if (p := ROOT / "bench" / room / f"{n}.py").exists())]


def _config_flags() -> set[str]:
    from shared.runtime.config.keys import FIELDS

    return {f"--{k.replace('_', '-')}" for k in FIELDS} | {"--config", "--worker-id"}


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and w != "--"]


def check_module(module: str, args: list[str], env: dict[str, str]) -> str:
    if not module.startswith("services."):
        return ""
    base = ROOT / Path(*module.split("."))
    files = [p for p in (base.with_suffix(".py"), base / "__main__.py") if p.exists()]
    if not files:
        return f"no module {module} ({base.relative_to(ROOT)}.py or {base.relative_to(ROOT)}/__main__.py)"
    args = fill_placeholders(args[1:] if args[:1] == ["--"] else args)
    unknown = [f for f in _flags(args) if f not in _config_flags() and not _source_names_flag(files, f)]
    if unknown:
        return f"{module} takes no {', '.join(unknown)}"
    values, i = {}, 0
    while i < len(args):
        if args[i].startswith("--") and args[i] in _config_flags() - {"--config", "--worker-id"}:
            key, value = args[i][2:].replace("-", "_"), args[i + 1] if i + 1 < len(args) else ""
            values[key] = value
            i += 1
        i += 1
    return _check_config(values, env)


def check_python(words: list[str], env: dict[str, str]) -> str:
    rest = words[1:]
    if rest[:1] == ["-c"]:
        return ""
    if rest[:2] == ["-m", "pytest"]:
        return _check_test_paths(rest[2:])
    if rest[:1] == ["-m"]:
        return check_module(rest[1], rest[2:], env) if len(rest) > 1 else "python -m without a module"
    if not rest:
        return ""
    script = ROOT / rest[0]
    if not script.exists():
        return f"no file {rest[0]}"
    if script.suffix == ".py" and script.relative_to(ROOT).parts[:1] == ("bench",):
        unknown = [
            f
            for f in _flags(fill_placeholders(rest[1:]))
            if f not in ("--help", "-h") and not _source_names_flag(_bench_sources(script), f)
        ]
        if unknown:
            return f"{rest[0]} takes no {', '.join(unknown)}"
    return ""


def check_dev(args: list[str], env: dict[str, str]) -> str:
    subcommands = re.findall(r"^\s+(\w+)\)", (ROOT / "dev").read_text(), flags=re.M)
    if not args or args[0] not in subcommands:
        return f"./dev has no subcommand {args[:1]} (it has {subcommands})"
    if args[0] == "run":
        return check_streamrl(["run", *args[1:]], env)
    return _check_test_paths(args[1:])


def _check_test_paths(args: list[str]) -> str:
    for a in args:
        if a.startswith("tests/") and "<" not in a and not (ROOT / a.split("::")[0]).exists():
            return f"no test path {a}"
    return ""


def check_command(words: list[str]) -> str:
    """ "" when the command is one the code accepts (or one this test does not know), else why not."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words[0].split("=", 1)
        env[k] = v
        words = words[1:]
    if words[:1] == ["timeout"] and len(words) > 1:
        words = words[2:]
    if not words:
        return ""
    env = {k: v for k, v in env.items() if k.startswith("STREAMRL_") or k == "REDIS_URL"}
    # .venv-vllm/bin/streamrl, ...
    head = words[0].rsplit("/", 1)[-1] if words[0] != "./dev" else words[0]
    if head == "streamrl":
        return check_streamrl(words[1:], env)
    if head == "./dev":
        return check_dev(words[1:], env)
    if PYTHONS.match(head):
        return check_python(words, env)
    if head == "torchrun" and "-m" in words:
        i = words.index("-m")
        return check_module(words[i + 1], words[i + 2 :], env)
    if head == "pip" and "install" in words:
        extras = re.search(
            r"^\[project\.optional-dependencies\]\n(.*?)^\[", (ROOT / "pyproject.toml").read_text(), flags=re.M | re.S
        )
        known = set(re.findall(r"^(\w+)\s*=", extras.group(1), flags=re.M)) if extras else set()
        for w in words:
            if m := re.fullmatch(r"\.\[([\w,]+)\]", w):
                if missing := set(m.group(1).split(",")) - known:
                    return f"pyproject.toml has no extra {sorted(missing)}"
        return ""
    if head == "honcho" and "-c" in words:
        names = set(re.findall(r"^(\w+):", (ROOT / "Procfile").read_text(), flags=re.M))
        for spec in words[words.index("-c") + 1].split(","):
            if spec.split("=")[0] not in names:
                return f"the Procfile has no process {spec.split('=')[0]!r}"
    return ""


def all_commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for no, line in command_lines(doc.read_text()):
            out.append((f"{doc.relative_to(ROOT)}:{no}", line))
    return out


def test_docs_hold_commands():
    """The collection itself works: the README's two commands and some CLI lines are found."""
    lines = [line for _, line in all_commands()]
    assert "./dev run" in " ".join(lines) and "./dev test" in " ".join(lines)
    assert sum(line.startswith("streamrl ") for line in lines) >= 10


def test_every_documented_command_is_accepted():
    bad = []
    for where, line in all_commands():
        try:
            segs = segments(line)
        except ValueError as exc:
            bad.append(f"{where}: {line!r}: cannot split it as a shell line ({exc})")
            continue
        for words in segs:
            if why := check_command(words):
                bad.append(f"{where}: {line!r}: {why}")
    assert not bad, "commands in README.md / docs/*.md that the code does not accept:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "line",
    [
        # the episode argument is required
        "streamrl replay",
        "streamrl nosuchcommand",
        "streamrl status --no-such-flag",
        # a config value of the wrong type
        "streamrl run --max-versions many",
        "STREAMRL_LR=fast streamrl config",
        "./dev nosuch",
        "./dev run --group-size x",
        "./dev test tests/no_such_file.py",
        "python bench/no_such_bench.py",
        "python bench/log/event_log.py --no-such-flag",
        "python -m services.no_such_service",
        "python -m services.trainer --no-such-flag 1",
        "python -m pytest tests/no_such_test.py",
        ".venv-vllm/bin/streamrl run --engine",
        "pip install -e '.[nosuchextra]'",
        "honcho start -c nosuch=2",
    ],
)
def test_a_wrong_command_is_refused(line):
    assert any(check_command(w) for w in segments(line)), f"{line!r} should be refused"


@pytest.mark.parametrize(
    "line",
    [
        "streamrl replay <episode-id> --continue [--from-seq N] [--version V]",
        "STREAMRL_LR=1e-3 streamrl config --run mine",
        # --budget comes from async_vs_sync's args
        "python bench/learning/trajectory_async.py --budget 3072 --workers 8",
        "torchrun --nproc-per-node 2 -m services.trainer -- --run NAME",
        "./dev test tests/<area>",
    ],
)
def test_a_good_command_is_accepted(line):
    assert not [why for w in segments(line) if (why := check_command(w))]


def test_command_lines_of_a_block():
    text = "```bash\nstreamrl run \\\n  --run x   # two lines\n# a comment\n```\n```\n$ streamrl check\noutput\n```\n"
    assert command_lines(text) == [(2, "streamrl run --run x   # two lines"), (7, "streamrl check")]


def test_headline_benchmark_commands_are_accepted():
    """bench/harness/headline.py shows these commands for rows not measured yet."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("headline", ROOT / "bench" / "harness" / "headline.py")
    headline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headline)
    bad = [f"{cmd}: {why}" for _, _, cmd, _ in headline.HEADLINES for w in segments(cmd) if (why := check_command(w))]
    assert not bad, bad
