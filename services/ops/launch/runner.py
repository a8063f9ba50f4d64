"""`streamrl run`: the whole job on one machine, from the same Procfile that
`honcho start` uses. Starts the embedded Redis on a free loopback port over the
run's own data (``<run_dir>/<run>/redis``, the folder the Procfile's ``streamrl
redis`` serves too), unless REDIS_URL is set (then that server is used and the
Procfile's redis line is skipped), runs every other line under honcho, ends when
the driver ends, and then runs the end-of-run check."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

from honcho.environ import parse_procfile
from honcho.manager import Manager
from honcho.printer import Printer

from services.driver.driver import ENDED
from services.driver.failfast import CANNOT_TRAIN
from services.ops.launch import starter_client
from services.ops.launch.keep import NAME_ENV, PID_DIR_ENV, keep_server, mark_injected
from services.ops.launch.keep import processes as keep_processes
from services.ops.launch.redis_server import start_for_run
from shared.runtime import runstate, secrets
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.connection import redact

# Procfile lines started only when config 'agent' is set
AGENT_PROCESSES = ("gateway", "agents")


def archive_ended_run(cfg: Config, who: str = "streamrl run") -> Path | None:
    """A run the driver ended is done: move its folder aside (runs/<run>.<time>), its Redis data with it, and its
    weights folder (the default one, keyed by its id) into it as ``weights/``, so this one starts afresh and nothing
    of the ended run is lost; nothing of another run (another id) is touched. A run that was interrupted (no ENDED
    file) is continued from its streams and checkpoint instead. The one rule for `streamrl run` and `honcho start`
    (whose `streamrl redis` calls it)."""
    if not (cfg.run_path / ENDED).exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime((cfg.run_path / ENDED).stat().st_mtime))
    dest = cfg.run_path.with_name(f"{cfg.run}.{stamp}")
    marker = runstate.read_marker(cfg.run_path) or {}
    cfg.run_path.rename(dest)
    kept = ""
    # the ended run's own weights folder (keyed by its id): with it
    if not cfg.weights_dir and marker.get("id"):
        ended = cfg.replace(run_id=marker["id"])
        if ended.weights_path.is_dir() and not (dest / "weights").exists():
            shutil.move(str(ended.weights_path), str(dest / "weights"))
            kept = ", its kept weights in weights/"
        # a rollout worker's downloads: copies of those, made by the run
        if not cfg.rollout_weights_dir:
            shutil.rmtree(ended.rollout_weights_path, ignore_errors=True)
    print(
        f"{who}: run {cfg.run!r} had ended; its files are now in {dest}{kept}; starting it afresh",
        file=sys.stderr,
        flush=True,
    )
    return dest


# the checkout streamrl runs from: its Procfile
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


def find_procfile(procfile: str) -> Path:
    """``procfile`` as given, else (a relative name not found here) the same name at the package's root."""
    path = Path(procfile)
    if path.exists():
        return path
    if not path.is_absolute() and (PACKAGE_ROOT / path).exists():
        return PACKAGE_ROOT / path
    raise ConfigError(
        f"--procfile {procfile}: no such file in {Path.cwd()}"
        + ("" if path.is_absolute() else f" nor in streamrl's checkout {PACKAGE_ROOT}")
    )


# what an interrupted run's checkpoint is of
MODEL_KEYS = ("model_dir", "tokenizer", "lora_rank", "lora_targets")


def check_continuation(cfg: Config) -> None:
    """An interrupted run continues with the model it was made with (its checkpoint is of that model): another
    one is a ConfigError, one line per key, before anything starts."""
    if (cfg.run_path / ENDED).exists():
        # an ended run is moved aside: this one starts afresh with whatever model it names
        return
    made = runstate.recorded_config(runstate.read_marker(cfg.run_path))
    lines = [
        f"config key {key!r}: run {cfg.run!r} was interrupted; it was made with {key} {made[key]!r} "
        f"({cfg.run_path / runstate.MARKER}), not {getattr(cfg, key)!r}: continue it with --{key.replace('_', '-')} "
        f"{made[key]}, or start another with --run NAME"
        for key in MODEL_KEYS
        if key in made and made[key] != getattr(cfg, key)
    ]
    from services.ops.launch.default_model import default_recipe
    from shared.runtime.models import is_default

    # the default model is remade for another recipe: not here
    if made and not lines and is_default(cfg.model_dir):
        # a run recorded before model_moe was a key was made on the dense model
        kept = {k: made[k] for k in ("agent", "tools", "dataset", "seed") if k in made}
        was = default_recipe(cfg.replace(**kept, model_moe=made.get("model_moe", "")))
        if {**was, "warm_steps": None} != {**default_recipe(cfg), "warm_steps": None}:
            lines.append(
                f"config key 'model_dir': run {cfg.run!r} was interrupted; it was made on the default model "
                f"for {was}, and this run wants {default_recipe(cfg)}, which would remake {cfg.model_dir} "
                f"under its checkpoint: continue it with the settings it was made with "
                f"({cfg.run_path / runstate.MARKER}), or start another with --run NAME"
            )
    if lines:
        raise ConfigError("\n".join(lines))


class LinePrinter(Printer):
    """honcho's printer, except that a reader gone away (``streamrl run | head``, a killed benchmark reading the
    pipe) silences the output, not the run. honcho's loop let the BrokenPipeError out: the run stopped printing and
    supervising, every process went on, and SIGINT/SIGTERM no longer reached them (its handler prints first)."""

    def write(self, message):
        try:
            super().write(message)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            # what Python's docs advise on SIGPIPE: later writes go nowhere
            os.dup2(devnull, self.output.fileno())
            os.close(devnull)


def own_server(cfg: Config) -> bool:
    """Whether the run uses a Redis of the user's (``REDIS_URL``, or a ``redis_url`` at another address than the
    default's, from a flag, a config file or ``STREAMRL_REDIS_URL``) rather than its embedded one on a free port.
    The default address with a password only sets the embedded server's password."""
    from urllib.parse import urlsplit

    address = lambda url: (lambda u: (u.scheme, u.hostname, u.port, u.path))(urlsplit(url))  # noqa: E731
    return "REDIS_URL" in os.environ or address(cfg.redis_url) != address(Config().redis_url)


def reachable(url: str, wait: float = 10.0) -> None:
    """The user's own server answers, or one line (ConfigError) before any process starts."""
    from shared.runtime.connection import connect

    try:
        connect(url, wait=wait).ping()
    except Exception as exc:  # noqa: BLE001 - refused, timed out, a wrong password: the reason goes in the line
        raise ConfigError(
            f"config key 'redis_url': {type(exc).__name__}: {exc}; start that server, or "
            f"leave redis_url (and REDIS_URL) unset for the run's own embedded server"
        ) from None


def processes(cfg: Config, entries: dict[str, str]) -> list[tuple[str, str, dict]]:
    """(process name, command, its own config keys) for each process to start from the Procfile's ``entries``:
    the redis line is the runner's own server, the agent lines only with an agent, the archiver only with a
    ``log_retention_versions``; ``rollout`` and ``agents``
    as many times as the config says (``rollout.1``, ``rollout.2``... like ``honcho start -c rollout=N``), the
    last ``longtail_workers`` rollout copies as long-tail workers."""
    out = []
    for name, cmd in entries.items():
        if (
            name == "redis"
            or (name in AGENT_PROCESSES and not cfg.agent)
            or (name == "archiver" and not cfg.log_retention_versions)
        ):
            continue
        # agents workers each run agent_concurrency episodes at once; rollout workers each drive one engine
        copies = {"agents": cfg.agent_workers, "rollout": cfg.rollout_workers}.get(name, 1)
        for i in range(copies):
            own = {"rollout_role": "longtail"} if name == "rollout" and i >= copies - cfg.longtail_workers else {}
            out.append((name if copies == 1 else f"{name}.{i + 1}", cmd, own))
    return out


def run(cfg: Config, procfile: str = "Procfile", extra_env: dict | None = None, chaos=None) -> int:
    """``chaos``: a ``services.ops.launch.chaos.Chaos`` to kill processes while the run goes (``--chaos``)."""
    path = find_procfile(procfile)
    entries = parse_procfile(path.read_text()).processes
    from services.ops.launch import preflight
    from services.ops.launch.default_model import ensure_model

    check_continuation(cfg)
    # the run's warm starter: its processes (and their restarts) fork from it with torch already imported. Started
    # first, so the preflight runs in it too, unless this process has torch already (then the preflight is cheap here).
    # A starter this process was handed (STARTER_SOCKET: the tests share one per worker) serves instead, not closed here
    warm, sock = None, starter_client.inherited()
    if sock is None and "torch" not in sys.modules:
        warm, sock = _launch_starter(wait=False)
    try:
        # before anything starts: a model_dir that does not resolve is one line, nothing to clean up
        ensure_model(cfg)
        if warm is not None and not _ready(warm):
            starter_client.close(warm, sock)
            warm, sock = None, None
        # every problem found from files and imports, one line each; nothing under runs/ yet
        preflight.check(cfg, sock)
        if sock is None:
            warm, sock = _launch_starter(wait=True)
        return _run(cfg, entries, sock, extra_env, chaos)
    finally:
        if warm is not None:
            starter_client.close(warm, sock)


def _launch_starter(wait: bool):
    """(process, socket path) of a new starter, or (None, None) when it cannot start (the run goes on without)."""
    try:
        warm, sock = starter_client.launch(wait=False)
    except OSError as exc:
        print(f"streamrl run: the process starter did not start ({exc}); processes start without it", file=sys.stderr)
        return None, None
    if wait and not _ready(warm):
        starter_client.close(warm, sock)
        return None, None
    return warm, sock


def _ready(warm) -> bool:
    try:
        starter_client.ready(warm)
        return True
    # the run goes on: each process starts the ordinary way
    except RuntimeError as exc:
        print(f"streamrl run: {exc}; its processes start without it", file=sys.stderr, flush=True)
        return False


def _run(cfg: Config, entries: dict, warm_path: str | None, extra_env: dict | None, chaos) -> int:
    server = None
    # every process gets the very same config: each key as STREAMRL_<KEY>
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    env.pop("STREAMRL_CONFIG", None)
    # the Procfile's lines call `streamrl` and `python`: this interpreter's, even when its venv is not activated
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # several torch processes share the cores: one thread each, not N fighting over N
    if cfg.device == "cpu":
        # (measured: a tiny model's decode step 4 ms vs 42 ms on 2 cores)
        env.setdefault("OMP_NUM_THREADS", "1")
    for f in fields(Config):
        env[f"STREAMRL_{f.name.upper()}"] = str(getattr(cfg, f.name))
    if not own_server(cfg):
        archive_ended_run(cfg)
        server = start_for_run(cfg)
        env["REDIS_URL"] = env["STREAMRL_REDIS_URL"] = secrets.without_password(server.url)
    # your own server: its secrets (the password in REDIS_URL included) stay where you put them
    else:
        reachable(cfg.redis_url)
        env.setdefault("REDIS_URL", cfg.redis_url)
        secrets.load_or_create(
            cfg.run_path, {"gateway_api_key": cfg.gateway_api_key, "weights_token": cfg.weights_token}
        )
    # every process reads them from the run's secrets file (0600), not from here
    for key in secrets.CONFIG_KEYS:
        env[f"STREAMRL_{key.upper()}"] = ""
    print(
        f"streamrl run: run {cfg.run!r} on {redact(env['REDIS_URL'])}{' (embedded, append-only)' if server else ''}",
        file=sys.stderr,
        flush=True,
    )
    # each `streamrl keep` writes its process's pid and restarts here
    pid_dir = cfg.run_path / "procs"
    for old in pid_dir.glob("*.pid") if pid_dir.is_dir() else []:
        old.unlink()
    env[PID_DIR_ENV] = str(pid_dir)
    env.pop(starter_client.ENV, None)
    # vLLM starts its own engine processes: its workers start cold, as tested
    if warm_path and cfg.engine == "torch":
        env[starter_client.ENV] = warm_path
    manager = Manager(printer=LinePrinter(sys.stdout))
    # the driver's progress lines are the view; the services' per-step info lines would bury them
    quiet = {**env, "STREAMRL_LOG_LEVEL": "warning"} if cfg.log_level == "info" else env
    for name, cmd, own in processes(cfg, entries):
        manager.add_process(
            name,
            cmd,
            env={
                **(env if name == "driver" else quiet),
                NAME_ENV: name,
                **{f"STREAMRL_{k.upper()}": str(v) for k, v in own.items()},
            },
        )
    started = time.time()
    stop_watch = threading.Event()
    watcher = None
    # the services survive a Redis crash: start it again, as `streamrl keep` does every Procfile line
    if server:
        watcher = keep_server(server, stop_watch)
    ended = lambda: (cfg.run_path / ENDED).exists() and (cfg.run_path / ENDED).stat().st_mtime >= started  # noqa: E731
    if chaos is not None:
        chaos.start(
            stop_watch,
            lambda: keep_processes(pid_dir),
            server,
            ended,
            out=sys.stderr,
            mark=lambda pid: mark_injected(pid_dir, pid),
        )
    try:
        manager.loop()
        if ended():
            export_at_end(cfg, warm_path)
            restarts = {name: r for name, (_, r) in keep_processes(pid_dir).items()}
            if watcher is not None:
                restarts["redis"] = watcher.restarts
            # the runner's own: with the run's password
            own_url = server.url if server else env["REDIS_URL"]
            # last: the lines a person reads when the run is over
            end_of_run_check(cfg, own_url, restarts)
            if chaos is not None:
                print_chaos(cfg, own_url, chaos, restarts, time.time() - started)
    finally:
        stop_watch.set()
        if server:
            server.stop()
    code = manager.returncode or 0
    # the driver said why in one line (services/driver/failfast.py): the run failed
    return 1 if code == CANNOT_TRAIN else code


def print_chaos(cfg: Config, redis_url: str, chaos, restarts: dict[str, int], seconds: float) -> None:
    from services.ops.launch.chaos import summary, version_times
    from shared.protocol.keys import Keys
    from shared.runtime.connection import connect

    times = version_times(cfg.run_path, cfg.steps_per_version)
    if not times:
        client = connect(redis_url, wait=10)
        times = [int(entry_id.decode().split("-")[0]) / 1000 for entry_id, _ in client.xrange(Keys(cfg.run).versions)]
    print("streamrl run: " + "\n".join(summary(chaos, times, restarts, seconds)), file=sys.stderr, flush=True)


def end_of_run_check(cfg: Config, redis_url: str, restarts: dict[str, int] | None = None) -> None:
    """After every process has stopped (warm), so each worker's final record is in: every count is known."""
    from services.ops.check.checker import check, format_report, read_run
    from shared.protocol.keys import Keys
    from shared.runtime.connection import connect

    client = connect(redis_url, wait=10)
    rq_client = connect(cfg.rq_redis_url, wait=10) if cfg.rq_redis_url else None
    report = check(read_run(client, Keys(cfg.run), cfg.run_path, rq_client, cfg))
    restarted = ", ".join(f"{name} {n}" for name, n in sorted((restarts or {}).items()) if n) or "none"
    *rows, verdict = format_report(report, cfg.run).split("\n")
    print(
        "streamrl run: streamrl check at the end of the run (groups still in flight are not lost):\n"
        + "\n".join([*rows, f"  processes restarted: {restarted}", verdict]),
        file=sys.stderr,
        flush=True,
    )


def export_at_end(cfg: Config, warm_path: str | None = None) -> None:
    """The last published version as a Hugging Face folder in the run's folder (kept when the run is archived);
    in a process forked from the run's starter when there is one (this one need not import torch)."""
    from dataclasses import asdict

    marker = runstate.read_marker(cfg.run_path) or {}
    # its weights folder is keyed by the id
    cfg = cfg.replace(run_id=marker.get("id", cfg.run_id))
    try:
        out = starter_client.call(warm_path, "services.trainer.export:export_last_of", {"config": asdict(cfg)})
    # it said why above: the same again here would only say it twice
    except starter_client.ChildFailed as exc:
        print(f"streamrl run: the export at the end failed ({exc})", file=sys.stderr, flush=True)
        out = None
    except starter_client.CallFailed:
        from services.trainer.export import export_last

        out = export_last(cfg)
    if out:
        print(
            f"streamrl run: exported the last version to {out} (AutoModelForCausalLM.from_pretrained loads it)",
            file=sys.stderr,
            flush=True,
        )
