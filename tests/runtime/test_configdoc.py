"""Help text and `streamrl config`, generated from the config source's section comments and field docstrings."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from dataclasses import fields

import pytest

from services.ops.cli.main import build_parser
from shared.runtime.config import doc as configdoc
from shared.runtime.config.keys import Config

SOURCE = '''
from dataclasses import dataclass

@dataclass
class Config:
    # where
    run: str = "demo"
    """namespaces every key"""
    # gateway
    port: int = 8000
    """the port "#1" listens on,
    over two lines"""
    workers: int = 2
    def replace(self): ...
'''


def test_parse_reads_sections_and_field_docstrings():
    docs = configdoc.parse(SOURCE)
    assert [(d.name, d.section, d.description, d.type) for d in docs.values()] == [
        ("run", "where", "namespaces every key", "str"),
        ("port", "gateway", 'the port "#1" listens on, over two lines', "int"),
        ("workers", "gateway", "", "int"),
    ]


def test_every_config_key_has_a_section_and_a_description():
    """The style others add keys in: `name: type = default`, its docstring under it, under a `# section`."""
    docs = configdoc.docs()
    assert list(docs) == [f.name for f in fields(Config)]
    assert not [d.name for d in docs.values() if not d.section or not d.description]
    assert docs["lr"].section == "trainer" and docs["dataset"].section == "the run (driver)"


def help_of(*argv: str) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    return sub.format_help()


@pytest.mark.parametrize(
    "command, shown, hidden",
    [
        ("redis", ["--run-dir", "--redis-url"], ["--lr", "--clip-high", "--dataset"]),
        ("check", ["--run"], ["--lr", "--engine"]),
        ("drive", ["--max-versions", "--dataset"], ["--lr", "--engine"]),
        ("replay", ["--engine", "--reward-fn", "--model-dir"], ["--lr", "--max-versions"]),
        ("run", ["--lr", "--engine", "--dataset", "--flush-ms"], []),
    ],
)
def test_each_subcommand_lists_its_keys_with_description_and_default(command, shown, hidden):
    # argparse wraps lines
    text = " ".join(help_of(command).split())
    docs = configdoc.docs()
    for flag in shown:
        doc = docs[flag[2:].replace("-", "_")]
        assert f"{flag} {doc.type.upper()} {' '.join(doc.description.split())} (default {doc.default!r})" in text
    for flag in hidden:
        assert f"{flag} " not in text
    if hidden:
        assert "more config keys are accepted here too" in text


def test_hidden_keys_are_still_accepted():
    args = build_parser().parse_args(["redis", "--lr", "0.5"])
    assert args.cfg_lr == "0.5"


def test_service_help_lists_that_services_keys():
    out = subprocess.run(
        [sys.executable, "-m", "services.syncer", "--help"], capture_output=True, text=True, timeout=60
    )
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "--sync-timeout FLOAT seconds the syncer waits" in text
    assert "--lr " not in text and "--dataset " not in text


def test_config_prints_the_effective_config_with_sources(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('lr = 0.001\ngroup_size = 4\nrun = "fromfile"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    env.update({"STREAMRL_GROUP_SIZE": "6", "REDIS_URL": "redis://127.0.0.1:7001/0"})
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "config", "--config", str(toml), "--run", "fromflag"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # the output is itself a config file
    values = tomllib.loads(out.stdout)
    assert values["lr"] == 0.001 and values["group_size"] == 6 and values["run"] == "fromflag"
    assert set(values) == {f.name for f in fields(Config)}
    lines = {line.split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["lr"].endswith(f"# file {toml}")
    assert lines["group_size"].endswith("# environment STREAMRL_GROUP_SIZE")
    assert lines["redis_url"].endswith("# environment REDIS_URL")
    assert lines["run"].endswith("# flag --run")
    assert lines["batch_groups"].endswith("# default")
