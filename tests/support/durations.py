"""Each test file's measured seconds, so the test workers start the longest files first (tests/conftest.py).

    ./dev test --junitxml=/tmp/suite.xml && python -m tests.support.durations /tmp/suite.xml

writes tests/durations.json: {file: seconds} summed over its tests (setup included), rounded. A file not in it
weighs its `slow` markers' seconds. Regenerate it when a file's time changes by tens of seconds: a stale entry only
costs the order, never a result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "durations.json"


def file_seconds(junit_xml: str | Path) -> dict[str, float]:
    """{tests/…/test_x.py: seconds} from a JUnit XML report (pytest's --junitxml)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        name = case.get("classname") or ""
        if not name:
            continue
        # pytest writes tests.ops.test_x for tests/ops/test_x.py
        path = name.replace(".", "/") + ".py"
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time") or 0.0)
    return {path: round(s, 1) for path, s in sorted(seconds.items())}


def load() -> dict[str, float]:
    try:
        return json.loads(PATH.read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.durations JUNIT_XML", file=sys.stderr)
        return 2
    seconds = file_seconds(argv[0])
    if not seconds:
        print(f"{argv[0]}: no test cases in it", file=sys.stderr)
        return 2
    PATH.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{PATH}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
