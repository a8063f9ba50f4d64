"""requirements.lock (what ./dev installs) against pyproject.toml (the ranges): every dependency that
pyproject.toml declares for '.[test]' is locked, at one exact version inside its range, so the two cannot
drift apart silently (./dev installs the lock with --no-deps for the project itself)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def locked(text: str) -> dict[str, Version]:
    """{canonical name: version} from a lock's ``name==version`` lines; anything else but comments is refused."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and name and version and not any(c in name for c in " <>=!~;@["), (
            f"requirements.lock line {n} is not name==version: {line!r}"
        )
        assert canonicalize_name(name) not in out, f"requirements.lock names {name} twice"
        out[canonicalize_name(name)] = Version(version)
    return out


def problems(pyproject: dict, lock: dict[str, Version], extras: tuple[str, ...] = ("test",)) -> list[str]:
    project = pyproject["project"]
    declared = list(project["dependencies"]) + [d for e in extras for d in project["optional-dependencies"][e]]
    found = []
    for spec in map(Requirement, declared):
        if spec.marker is not None and not spec.marker.evaluate():
            continue
        version = lock.get(canonicalize_name(spec.name))
        if version is None:
            found.append(f"{spec.name} ({spec}) is not in requirements.lock")
        elif not spec.specifier.contains(version, prereleases=True):
            found.append(f"requirements.lock has {spec.name}=={version}, outside pyproject.toml's {spec}")
    return found


def test_the_lock_names_every_declared_dependency_inside_its_range():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lock = locked((ROOT / "requirements.lock").read_text())
    assert problems(pyproject, lock) == []
    # the project itself is installed editable, never from the lock
    assert "streamrl" not in lock
    # no local label (torch==2.13.0+cpu): the package index has none; pip still picks +cpu where it is offered
    assert all(v.local is None for v in lock.values()), {n: str(v) for n, v in lock.items() if v.local}


def test_the_check_reports_a_missing_and_an_out_of_range_dependency():
    pyproject = {
        "project": {
            "dependencies": ["transformers>=5.24", "redis[hiredis]>=5.0"],
            "optional-dependencies": {"test": ["pytest>=8"]},
        }
    }
    lock = locked("# header\ntransformers==5.23.0\nRedis==8.1.0\n")
    assert lock == {"transformers": Version("5.23.0"), "redis": Version("8.1.0")}
    assert problems(pyproject, lock) == [
        "requirements.lock has transformers==5.23.0, outside pyproject.toml's transformers>=5.24",
        "pytest (pytest>=8) is not in requirements.lock",
    ]
    for line in ("-e .", "torch @ file:///tmp/torch.whl", "numpy>=2"):
        with pytest.raises(AssertionError, match="not name==version"):
            locked(line)
