"""The config's documentation, read from the config's own source: one source of truth.

In ``shared/runtime/config/keys.py`` each field of ``Config`` carries its description as an attribute
docstring (the string literal on the lines under the field), and full-line comments (``# rollout``,
``# trainer``, ...) open a section that groups the keys by the service that reads them. This module parses
that file (ast for the fields and their docstrings, tokenize for the section comments), so a key added in
that style shows up in every ``--help`` and in ``streamrl config`` with nothing else to edit.
"""

from __future__ import annotations

import argparse
import ast
import io
import textwrap
import tokenize
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from pathlib import Path

from shared.runtime.config import keys as configmod

PRECEDENCE = "defaults < TOML file (--config / STREAMRL_CONFIG) < environment STREAMRL_<KEY> (and REDIS_URL) < flags"


@dataclass(frozen=True)
class KeyDoc:
    name: str
    # the full-line comment above it, e.g. "rollout"
    section: str
    # its attribute docstring, joined into one line ("" when it has none)
    description: str
    default: object
    type: str


def parse(source: str) -> dict[str, KeyDoc]:
    """KeyDocs of the fields of class ``Config`` in ``source``, in source order."""
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"), None)
    if cls is None:
        raise ValueError("no class Config in the config source")
    # line -> a comment alone on its line (the section headers)
    full_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip():
            full_line[tok.start[0]] = tok.string.lstrip("#").strip()
    defaults = {f.name: f.default for f in fields(configmod.Config)}
    out: dict[str, KeyDoc] = {}
    section = ""
    last_line = cls.lineno + 1
    for node, following in zip(cls.body, [*cls.body[1:], None]):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        headers = [full_line[i] for i in range(last_line, node.lineno) if i in full_line]
        if headers:
            section = headers[-1]
        last_line = node.end_lineno + 1
        description = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            if isinstance(following.value.value, str):
                description = " ".join(following.value.value.split())
                last_line = following.end_lineno + 1
        name = node.target.id
        default = defaults.get(name, MISSING)
        out[name] = KeyDoc(
            name, section, description, None if default is MISSING else default, ast.unparse(node.annotation)
        )
    return out


@lru_cache(maxsize=1)
def docs() -> dict[str, KeyDoc]:
    return parse(Path(configmod.__file__).read_text())


def sections() -> list[str]:
    return list(dict.fromkeys(d.section for d in docs().values()))


def matching(words: tuple[str, ...] | None) -> list[str]:
    """Sections whose title contains one of ``words`` (None: every section)."""
    return [s for s in sections() if words is None or any(w in s for w in words)]


def add_arguments(parser: argparse.ArgumentParser, shown: tuple[str, ...] | None = None) -> None:
    """One ``--<key>`` flag per config key, plus ``--config FILE``. The keys of the sections matching
    ``shown`` are listed with description and default; every other key is accepted but not listed."""
    keep = set(matching(shown))
    parser.add_argument("--config", metavar="FILE", help="TOML file of config keys")
    groups = {s: parser.add_argument_group(f"{s} keys") for s in sections() if s in keep}
    for doc in docs().values():
        target = groups.get(doc.section, parser)
        help_text = (
            (f"{doc.description} (default {doc.default!r})" if doc.description else f"default {doc.default!r}")
            if doc.section in keep
            else argparse.SUPPRESS
        )
        target.add_argument(
            f"--{doc.name.replace('_', '-')}",
            dest=f"cfg_{doc.name}",
            metavar=doc.type.upper(),
            default=None,
            help=help_text.replace("%", "%%"),
        )
    hidden = len(docs()) - sum(d.section in keep for d in docs().values())
    note = (
        f"{hidden} more config keys are accepted here too (`streamrl config --help` lists every key). "
        if hidden
        else ""
    )
    parser.epilog = textwrap.fill(f"{note}Precedence: {PRECEDENCE}.", 100)


def render(cfg: configmod.Config, sources: dict[str, str]) -> str:
    """The effective config as TOML (so it can be saved as a --config file), each key with its source."""
    lines = []
    for section in sections():
        lines.append(f"# {section}")
        for doc in (d for d in docs().values() if d.section == section):
            value = getattr(cfg, doc.name)
            text = (
                ("true" if value else "false")
                if isinstance(value, bool)
                else _toml_string(value)
                if isinstance(value, str)
                else repr(value)
            )
            lines.append(f"{doc.name} = {text}  # {sources.get(doc.name, 'default')}")
    return "\n".join(lines)


def _toml_string(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{out}"'
