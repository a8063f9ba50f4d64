"""`python -m tests.support.audited_rollout DENIED LOG <rollout args>`: a real rollout worker process
(services.rollout) in which the folder DENIED does not exist for reading: every open, listdir or scandir of a path
under it is refused (PermissionError) and written to LOG, one line each. The trainer's weights folder, as a worker on
another host sees it (tests run as root, so permissions cannot stand in for that)."""

from __future__ import annotations

import os
import sys

WATCHED = ("open", "os.listdir", "os.scandir")


def main() -> None:
    denied, log, args = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3:]

    def hook(event: str, a: tuple) -> None:
        if event not in WATCHED or not a or not isinstance(a[0], (str, bytes, os.PathLike)):
            return
        path = os.path.abspath(os.fsdecode(a[0]))
        if path == denied or path.startswith(denied + os.sep):
            # an open of LOG, not under DENIED: the hook lets it through
            with open(log, "a") as fh:
                fh.write(f"{event} {path}\n")
            raise PermissionError(f"{path}: denied (tests/support/audited_rollout.py: another host's folder)")

    sys.addaudithook(hook)
    from services.rollout.__main__ import main as rollout

    rollout(args)


if __name__ == "__main__":
    main()
