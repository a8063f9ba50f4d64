"""How many random cases a fuzz test draws: the full count in CI (CI=true, or FUZZ_FULL=1 by hand), a quarter of
it in a developer's `./dev test`. Hypothesis spends its time making cases (about 6 ms each for a stream entry on
this box), so the full 11,000-entry poison test alone took 70 CPU-seconds of a 5-minute suite; every assertion
runs either way, on fewer cases."""

from __future__ import annotations

import os


def cases(full: int) -> int:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("FUZZ_FULL") == "1":
        return full
    return max(full // 4, 50)
