"""Which run a command that names ``--run`` reads, and with what config: the run's folder (``runs/NAME``, or an
archived ``runs/NAME.<time>``), its Redis name (run.json's, which an archived folder keeps), the config the run
recorded (run.json) under the command's own settings, and a server that holds its data."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import redis

from shared.protocol.keys import Keys
from shared.runtime import runstate, secrets
from shared.runtime.config.keys import FIELDS, Config
from shared.runtime.connection import is_cluster, redact

# ended or archived too
READS_A_RUN = ("inspect", "replay", "check", "status", "export", "redis-cli", "episodes", "stop")
# keys that say where the command runs, not what the run was made of: never taken from the record
WHERE = ("run", "run_id", "redis_url", "rq_redis_url", "run_dir", "redis_wait", "log_level")


@dataclass
class Target:
    # the command's config over the run's recorded one; run_id and weights folder of this run
    cfg: Config
    # the run's keys (its own name, also for an archived folder)
    keys: Keys
    # the run's folder
    path: Path
    # its run.json
    marker: dict | None


def with_recorded(cfg: Config, sources: dict, recorded: dict, where: str) -> tuple[Config, list[str]]:
    """``cfg`` with each key it left at its default taken from ``recorded``; one line for each key the command
    sets (flag, environment, file) to something other than what the run was made with."""
    changes, notes = {}, []
    for key, value in recorded.items():
        if key in WHERE or key not in FIELDS or runstate.is_secret(key) and isinstance(value, str):
            continue
        current = getattr(cfg, key)
        if (
            value == current
            or type(value) is not type(current)
            and not (isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool))
        ):
            continue
        if key in sources:
            notes.append(
                f"{key} {current!r} ({sources[key]}) is not what run {cfg.run!r} was made with: "
                f"{value!r} ({where}); using {current!r}"
            )
        else:
            changes[key] = type(current)(value)
    return (cfg.replace(**changes) if changes else cfg), notes


def resolve(cfg: Config, sources: dict) -> tuple[Target, list[str]]:
    path = cfg.run_path
    marker = runstate.read_marker(path)
    if marker is None:
        return Target(cfg, Keys(cfg.run), path, None), []
    cfg, notes = with_recorded(cfg, sources, runstate.recorded_config(marker), str(path / runstate.MARKER))
    if marker.get("id"):
        cfg = cfg.replace(run_id=marker["id"])
    if not cfg.weights_dir and (path / "weights").is_dir() and not cfg.weights_path.is_dir():
        # an archived run's weights moved in with it
        cfg = cfg.replace(weights_dir=str(path / "weights"))
    return Target(cfg, Keys(marker.get("run") or cfg.run), path, marker), notes


def holds_run(url: str, target: Target) -> bool:
    """Whether the server at ``url`` answers and holds this very run (its id), not another of the same name."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=5)
        try:
            meta = runstate.read_meta(client, target.keys)
        finally:
            client.close()
    except (redis.exceptions.RedisError, OSError):
        return False
    return bool(meta) and (target.marker is None or meta.get("id") == target.marker.get("id"))


def serving_url(target: Target, sources: dict) -> str | None:
    """A server that holds the run: ``redis_url``, or (when the command did not name one) the one run.json
    recorded; None when neither does (then the run's own data can be served: serve_ended.py)."""
    url = target.cfg.redis_url
    if "redis_url" in sources or is_cluster(url):
        # the command named its server: that one, whatever it holds
        return url
    recorded = _recorded_url(target)
    candidates = [url] + [u for u in [recorded] if u and u != url]
    return next((u for u in candidates if holds_run(u, target)), None)


def _recorded_url(target: Target) -> str:
    """The server run.json recorded, with its password from the run's secrets file (run.json shows it as ***:
    the embedded Redis of `streamrl run` has one, on a port of its own); '' when none was recorded."""
    url = (target.marker or {}).get("redis", "")
    if not url:
        return ""
    plain = secrets.without_password(url)
    try:
        data = secrets.read(target.path)
    # unreadable (another user's run): the server without its password
    except (OSError, ValueError):
        return plain
    return secrets.fill({"redis_url": plain}, data).get("redis_url", plain)


def is_live(cfg: Config, folder: Path, marker: dict) -> bool:
    """Whether a server holds the run of ``folder`` now (`streamrl runs`)."""
    return serving_url(Target(cfg, Keys(marker.get("run", folder.name)), folder, marker), {}) is not None


def for_command(cfg: Config, sources: dict, args, stack) -> Config:
    """The config of a command that reads a run: the run's recorded config under the command's own settings
    (one line for each that differs), its keys and folder on ``args``, and its data served for the command
    when no server holds it (a copy, stopped when ``stack`` closes: services/ops/inspect/serve_ended.py)."""
    from services.ops.inspect import serve_ended

    target, notes = resolve(cfg, sources)
    for line in notes:
        print(f"streamrl {args.command}: {line}", file=sys.stderr, flush=True)
    args.keys, args.run_path, args.served = target.keys, target.path, False
    # export reads files only
    url = serving_url(target, sources) if args.command != "export" else None
    if url is None and args.command != "export" and serve_ended.has_data(target.path):
        url, args.served = stack.enter_context(serve_ended.ServedCopy(target.path)), True
        print(
            f"streamrl {args.command}: no server holds run {cfg.run!r}; serving a copy of {target.path / 'redis'} "
            f"on {redact(url)} for this command (the run's folder is not changed)",
            file=sys.stderr,
            flush=True,
        )
    return target.cfg.replace(redis_url=url) if url else target.cfg
