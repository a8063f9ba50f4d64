"""How many random cases a fuzz test draws: a tenth of its full count in `./dev test` (the developer's loop, the
same with CI=true or without), the full count with FUZZ_FULL=1, which CI's deep pass sets (.ci/run runs the fuzz
tests again so, after the suite). Hypothesis spends its time making cases (about 6 ms each for a stream entry on a
quiet box, 15 ms on a busy one), so the full 11,000-entry poison test alone is 70 to 160 CPU-seconds; every
assertion runs either way, on fewer cases."""

from __future__ import annotations

import os


def cases(full: int) -> int:
    if os.environ.get("FUZZ_FULL") == "1":
        return full
    return max(full // 10, 50)
