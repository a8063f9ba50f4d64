"""`streamrl schema`: every stream's (and shared key's) schema, from the docstring of its codec module.

One codec module per stream; its docstring is the stream's documentation, so this listing cannot drift
from the code. Events also print their generated field table (``events.describe``).
"""

from __future__ import annotations

import importlib
import inspect

# (title, codec module, the key(s) it owns: a Keys attribute or pattern)
STREAMS = (
    ("episode events", "shared.protocol.events", "ep:<episode id>"),
    ("prompt groups", "shared.protocol.prompts", "prompts, prompts:val"),
    ("samples", "shared.protocol.samples", "samples, samples:val"),
    ("versions", "shared.protocol.versions", "versions"),
    ("control", "shared.protocol.control", "control"),
    ("dead letters", "shared.protocol.dead_letters", "dead"),
    ("metrics", "shared.protocol.metrics", "metrics"),
    ("the trainer's ledger", "shared.protocol.ledger", "<run_dir>/<run>/trainer/trained.jsonl (a file)"),
    ("the staleness gate", "shared.protocol.gate", "gate, gate:started"),
    ("idempotent writes", "shared.protocol.once", "enqueued:*, sampled:*, control:sent:*, dead:seen:*, gate:req:*"),
)


def describe() -> str:
    """Markdown: one section per stream, its codec's docstring (and the event field table)."""
    out = ["Every key is `streamrl:<run>:<name>` (shared/protocol/keys.py).", ""]
    for title, module_name, keys in STREAMS:
        module = importlib.import_module(module_name)
        out += [f"## {title}: `{keys}` ({module_name.replace('.', '/')}.py)", "", inspect.cleandoc(module.__doc__ or ""),
                ""]
        if module_name.endswith(".events"):
            out += [module.describe(), ""]
    return "\n".join(out).rstrip() + "\n"
