"""`streamrl ui` in a real browser (the distribution's headless Chromium, driven by playwright) on a real short
run: the run page's charts advance while the run goes, without a reload; once it has ended: runs → run (with its
check) → episodes filtered to aborted ones → an episode whose token colours (policy versions) and abort / resume
markers are those of `streamrl replay --json`. A screenshot of each page goes to $UI_SCREENSHOTS (default: the
test's temp folder).

Chromium: /usr/bin/chromium (Debian's `chromium` package; ./dev test installs it with apt-get where it can). Missing,
the test skips with the reason, except under CI (CI=true), where it fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    why = "no chromium on PATH (apt-get install chromium; ./dev test does where it can)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser tests under CI: {why}")
    pytest.skip(why)


@pytest.fixture
def browser(tmp_path):
    path = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("playwright not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=path,
            args=ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield ctx
        finally:
            ctx.close()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    return {**env, "PYTHONPATH": str(ROOT)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait(what: str, ok, seconds: float, proc=None):
    deadline = time.monotonic() + seconds
    while not ok():
        assert proc is None or proc.poll() is None, f"{what}: the process ended (exit {proc.returncode})"
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.2)


def _shot(page, shots: Path, name: str) -> None:
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)


def test_the_pages_of_a_live_then_ended_run(tmp_path, tiny_model_dir, browser):
    runs, shots = tmp_path / "runs", Path(os.environ.get("UI_SCREENSHOTS") or tmp_path / "shots")
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli.main",
            "run",
            "--run",
            "live",
            "--model-dir",
            tiny_model_dir,
            "--run-dir",
            str(runs),
            "--weights-dir",
            str(tmp_path / "weights"),
            # a bound for a test gone wrong: the test ends the run itself (streamrl stop) once it saw it live
            "--max-minutes",
            "4",
            "--max-versions",
            "0",
            "--group-size",
            "4",
            "--batch-groups",
            "2",
            "--max-tokens",
            "48",
            "--val-every",
            "10",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=open(tmp_path / "run.log", "w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    ui = None
    try:
        _wait("the run's first step", lambda: (runs / "live" / "metrics.jsonl").exists(), 120, run)
        port = _port()
        ui = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.ops.cli.main",
                "ui",
                "--run",
                "live",
                "--run-dir",
                str(runs),
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=_env(),
            stdout=open(tmp_path / "ui.log", "w"),
            stderr=subprocess.STDOUT,
            text=True,
        )
        _wait("the ui's address", lambda: "streamrl ui: http" in (tmp_path / "ui.log").read_text(), 60, ui)
        line = next(x for x in (tmp_path / "ui.log").read_text().splitlines() if x.startswith("streamrl ui: http"))
        # with its key: once, then a cookie
        url = line.split()[2]
        _wait("the ui listening", lambda: _listening(port), 30, ui)
        base = url.split("/run/")[0]
        page = browser.new_page()
        # the key once: a cookie from then on
        page.goto(url)
        page.wait_for_selector("#chart-reward[data-points]")
        before = int(page.get_attribute("#chart-reward", "data-points"))
        page.wait_for_function(
            f"Number(document.getElementById('chart-reward').dataset.points) > {before}",
            # new steps drawn by the page's own polling: no reload
            timeout=60_000,
        )
        assert page.evaluate("document.getElementById('chart-reward').data[0].x.length") > before
        assert "(live)" in page.inner_text("#state")
        _shot(page, shots, "run-live")
        stop = subprocess.run(
            [sys.executable, "-m", "services.ops.cli.main", "stop", "--run", "live", "--run-dir", str(runs)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stop.returncode == 0 and "asked to end" in stop.stdout, stop.stdout + stop.stderr
        run.wait(timeout=240)
        log = (tmp_path / "run.log").read_text()
        assert run.returncode == 0 and "driver: asked to end the run (streamrl stop" in log, log[-3000:]

        page.goto(base + "/")
        page.wait_for_selector("table a")
        assert "ended" in page.inner_text("table")
        _shot(page, shots, "runs")
        page.click("text=live")
        # the ended run's check, read from its folder
        page.wait_for_selector("#check pre", timeout=60_000)
        assert "ok" in page.inner_text("#check")
        _shot(page, shots, "run-ended")

        page.goto(base + "/run/live/episodes")
        page.wait_for_selector("#total")
        page.fill("input[name=min_aborts]", "1")
        page.click("#apply")
        page.wait_for_function("document.querySelector('#count').textContent.includes('match')")
        page.wait_for_selector("a.ep")
        total = int(page.inner_text("#total"))
        assert total >= 1, "no episode of the run was aborted: nothing to compare"
        _shot(page, shots, "episodes-aborted")
        episode = page.inner_text("a.ep >> nth=0")
        page.click("a.ep >> nth=0")
        page.wait_for_selector("#response .tok")
        _shot(page, shots, "episode")

        replay = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.ops.cli.main",
                "replay",
                episode,
                "--json",
                "--run",
                "live",
                "--run-dir",
                str(runs),
            ],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert replay.returncode == 0, replay.stderr[-2000:]
        want = json.loads(replay.stdout)
        shown = page.eval_on_selector_all("#response .tok", "els => els.map(e => Number(e.dataset.version))")
        # each token coloured by the version the stream says made it
        assert shown == want["versions"]
        marks = page.eval_on_selector_all(
            "#response .marker[data-kind=aborted], #response .marker[data-kind=resumed], "
            "#response .marker[data-kind=takeover], #response .marker[data-kind=repacked]",
            "els => els.map(e => [e.dataset.kind, Number(e.dataset.at), e.dataset.worker, Number(e.dataset.version)])",
        )
        expected = sorted(
            [["aborted", a["num_tokens"], a["worker"], a["version"], a["seq"]] for a in want["aborts"]]
            + [
                [
                    "takeover" if r.get("takeover_from") else "repacked" if r.get("repacked") else "resumed",
                    r["num_tokens"],
                    r["worker"],
                    r["version"],
                    r["seq"],
                ]
                for r in want["resumes"]
            ],
            key=lambda m: (m[1], m[4]),
        )
        assert want["aborts"] and marks == [m[:4] for m in expected]
        colours = page.eval_on_selector_all("#response .tok", "els => els.map(e => e.style.background)")
        by_version = {}
        for v, c in zip(shown, colours):
            # one colour per version
            assert by_version.setdefault(v, c) == c
        # ... and another for each other version
        assert len(set(by_version.values())) == len(by_version)
        assert page.inner_text("#command") == f"streamrl replay {episode} --run live --continue"

        served = [pid for pid in _children(ui.pid) if b"valkey" in _read(f"/proc/{pid}/cmdline")]
        assert served, "the ended run is read from a served copy of its data"
        # as Ctrl-C or honcho stops it: the copy's server stops with it
        ui.terminate()
        assert ui.wait(timeout=30) == 0
        _wait("the served copy's server stopped with the ui", lambda: not any(_alive(p) for p in served), 30, None)
    finally:
        for proc in (ui, run):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    return [
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and _read(f"/proc/{p}/stat").rsplit(b")", 1)[-1].split()[1:2] == [str(pid).encode()]
    ]


def _alive(pid: int) -> bool:
    fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()
    return bool(fields) and fields[0] != b"Z"
