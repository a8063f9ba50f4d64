"""CPU seconds of a process tree, by process, read from /proc/<pid>/stat (utime + stime) by a thread that polls
every ``every_s``: each process's last reading counts (a process that lives less than one poll is missed, and each
loses at most its last ``every_s``). CPU seconds move far less with the box's load than wall-clock rates do."""

from __future__ import annotations

import os
import threading
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # after the command name, which may hold spaces
    fields = raw.rsplit(")", 1)[1].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _names(pid: int) -> str:
    """``[comm] command line``: a process the run's starter forked keeps the starter's command line, and says its
    module in its name (``comm``, e.g. ``archiver``)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    return f"[{comm}] {cmdline}"


class TreeCPU:
    """``with TreeCPU(root_pid) as t: ...``; then ``t.seconds`` {pid: CPU s}, ``t.commands`` {pid: ``[comm]
    command line``}."""

    def __init__(self, root: int, every_s: float = 0.25):
        self.root, self.every_s = root, every_s
        self.seconds: dict[int, float] = {}
        self.commands: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _poll(self) -> None:
        parents = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    parents[int(entry)] = st
        tree, frontier = {self.root}, [self.root]
        while frontier:
            frontier = [p for p, (ppid, _) in parents.items() if ppid in frontier and p not in tree]
            tree.update(frontier)
        for pid in tree:
            if pid in parents:
                self.seconds[pid] = parents[pid][1]
                # a fork names itself later
                self.commands[pid] = _names(pid) or self.commands.get(pid, "")

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._poll()

    def __enter__(self) -> "TreeCPU":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def total(self, contains: str = "", excluding: str | None = None) -> float:
        """CPU seconds of the processes whose command line holds ``contains`` (all of them: "") and not
        ``excluding``."""
        return sum(
            s
            for pid, s in self.seconds.items()
            if contains in self.commands.get(pid, "") and not (excluding and excluding in self.commands.get(pid, ""))
        )
