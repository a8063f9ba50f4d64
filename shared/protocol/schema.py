"""`streamrl schema`: every key the code builds (from ``keys.CATALOG``, rendered by the real ``Keys`` builders, so
the hash tags show as they are), then every stream's (and shared key's) schema from the docstring of its codec
module. One codec module per stream; its docstring is the stream's documentation, so this listing cannot drift
from the code. Events also print their generated field table (``events.describe``).
"""

from __future__ import annotations

import importlib
import inspect

from shared.protocol.keys import CATALOG, Keys

# (title, codec module) of the sections after the key table; the keys each owns come from keys.CATALOG
CODECS = (
    ("episode events", "shared.protocol.episode.events"),
    ("prompt groups", "shared.protocol.streams.prompts"),
    ("samples", "shared.protocol.streams.samples"),
    ("versions", "shared.protocol.streams.versions"),
    ("control", "shared.protocol.streams.control"),
    ("dead letters", "shared.protocol.streams.dead_letters"),
    ("metrics", "shared.protocol.streams.metrics"),
    ("repacks", "shared.protocol.streams.repacks"),
    ("pulls and the load lease", "shared.protocol.streams.pulls"),
    ("LLM calls", "shared.protocol.streams.calls"),
    ("the staleness gate", "shared.protocol.gate"),
    ("idempotent writes", "shared.protocol.streams.once"),
    ("the trainer's ledger (a file: <run_dir>/<run>/trainer/trained.jsonl)", "shared.protocol.archive.ledger"),
)


def key_of(keys: Keys, builder: str, args: tuple) -> str:
    """The key ``builder`` makes for ``args`` (a property takes none)."""
    attr = getattr(keys, builder)
    return attr(*args) if callable(attr) else attr


def key_table(run: str = "<run>") -> list[tuple[str, str, str, str, str]]:
    """(key as the code builds it, Keys builder, Redis type, owner module, what it holds), for every key."""
    keys = Keys(run)
    return [(key_of(keys, b, args), b, kind, owner, what) for b, args, kind, owner, what in CATALOG]


def describe() -> str:
    """Markdown: the key table, then one section per codec: its docstring (and the event field table)."""
    out = [
        "# Keys",
        "",
        "Every key of a run, as `shared/protocol/keys.py` builds it (`{...}`: a Redis Cluster hash tag; "
        "coordination keys share the run's, each episode stream has its own).",
        "",
        "| key | builder | type | owner | holds |",
        "|---|---|---|---|---|",
    ]
    out += [f"| `{key}` | `{b}` | {kind} | {owner} | {what} |" for key, b, kind, owner, what in key_table()]
    out.append("")
    for title, module_name in CODECS:
        module = importlib.import_module(module_name)
        path = module_name.replace(".", "/") + ".py"
        owned = [f"`{key}`" for key, _, _, owner, _ in key_table() if owner == path]
        out += [f"## {title}: {', '.join(owned) or 'no key'} ({path})", "", inspect.cleandoc(module.__doc__ or ""), ""]
        if module_name.endswith(".events"):
            out += [module.describe(), ""]
    return "\n".join(out).rstrip() + "\n"
