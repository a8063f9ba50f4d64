"""`streamrl`'s argument grammar: every subcommand, its flags and help, and the config flags it takes
(``config_sources.add_arguments``). The commands themselves, and ``main``, are in services/ops/cli/main.py."""

from __future__ import annotations

import argparse

from shared.runtime.config import sources as config_sources
from shared.runtime.config.checks import MOE_FAMILIES


def build_parser(commands) -> argparse.ArgumentParser:
    """The grammar; ``commands``: the module holding each subcommand's ``cmd_*`` function (services/ops/cli/main.py)."""
    from services.ops.launch.chaos import add_arguments as chaos_arguments

    parser = argparse.ArgumentParser(prog="streamrl", description=commands.__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func, help: str, shown: tuple[str, ...] | None = ("where",)) -> argparse.ArgumentParser:
        """``shown``: the config sections (full-line comments in shared/runtime/config/keys.py) that --help lists."""
        p = sub.add_parser(name, help=help, description=help, formatter_class=argparse.RawDescriptionHelpFormatter)
        config_sources.add_arguments(p, shown)
        p.set_defaults(func=func)
        return p

    p = add(
        "redis", commands.cmd_redis, "run the embedded Redis-protocol server in the foreground (port from redis_url)"
    )
    p.add_argument(
        "--data-dir",
        help="append-only files go here (default <run_dir>/<run>/redis, as under "
        "`streamrl run`; an ended run there is moved aside first)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=3.0,
        help="on SIGTERM, seconds to wait for clients to disconnect before stopping (default 3)",
    )
    p = add("inspect", commands.cmd_inspect, "list a run's streams with lengths, consumer groups and pending counts")
    p.add_argument("--episodes", action="store_true", help="list every episode stream too")
    p.add_argument("--json", action="store_true")
    p = add(
        "replay",
        commands.cmd_replay,
        "print an episode's timeline rebuilt from its stream",
        ("where", "model", "rollout"),
    )
    p.add_argument("episode", help="episode id (the part after ep: in the key)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-text", action="store_true", help="do not decode tokens to text")
    p.add_argument(
        "--routes",
        action="store_true",
        help="a mixture-of-experts policy: each response token's logged experts, layer by layer",
    )
    p.add_argument(
        "--continue",
        dest="cont",
        action="store_true",
        help="re-run the episode's continuation in-process (engine, tools, reward); writes nothing",
    )
    p.add_argument(
        "--from-seq",
        type=int,
        metavar="N",
        help="--continue from the state after event N (default: the last event before the finish)",
    )
    p.add_argument(
        "--version",
        type=int,
        metavar="V",
        help="--continue with policy version V's published weights (0: model_dir; default: the "
        "version in effect at the event)",
    )
    p.add_argument("--weights", metavar="PATH", help="--continue with this safetensors file (needs --version)")
    p.add_argument(
        "--from-call",
        type=int,
        metavar="K",
        help="agent episodes: --continue by running the agent again, calls before K answered from the "
        "stream, call K on generated (default: the last call); in a scratch Redis, writes nothing",
    )
    p = add(
        "status",
        commands.cmd_status,
        "the live view of a run (version, reward, validation, samples/s, staleness, workers)",
    )
    p.add_argument("--watch", action="store_true", help="print a line every --interval seconds until interrupted")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--json", action="store_true")
    p = add(
        "make-model",
        commands.cmd_make_model,
        "create the default tiny model at model_dir: random init + a short "
        "supervised warm start on the task (calc-tool format with --tools calc; chat episodes with the "
        "calc tool and a 1,024 context with --agent; a mixture of experts with --moe)",
        ("where", "model"),
    )
    p.add_argument(
        "--warm-steps",
        type=int,
        default=None,
        help="supervised steps of 32 examples (default 150, 100 with --moe qwen3; 400 with --agent)",
    )
    p.add_argument(
        "--moe",
        choices=MOE_FAMILIES,
        help="a mixture of experts of that family (8 experts, top-2) instead of the dense Llama: the same as "
        "--model-moe, which a run asks for its default model with",
    )
    p.add_argument("--force", action="store_true", help="replace a model already at model_dir")
    p = add(
        "export",
        commands.cmd_export,
        "save a version of the run as a Hugging Face folder (config, tokenizer, generation "
        "config, safetensors): <run_dir>/<run>/export/v<N> unless --out",
    )
    p.add_argument(
        "--version", type=int, metavar="V", help="a kept version (default: the newest; 0: the initial model)"
    )
    p.add_argument("--out", metavar="DIR", help="write the folder here instead")
    p = add(
        "run",
        commands.cmd_run,
        "run the whole job: embedded Redis + every Procfile process, until the driver ends",
        None,
    )
    p.add_argument("--procfile", default="Procfile")
    chaos_arguments(p)
    add("drive", commands.cmd_drive, "steer a run (the Procfile's driver line) and end it", ("where", "driver"))
    add(
        "stop",
        commands.cmd_stop,
        "end a live run now, as if it had reached max_versions: its driver stops it and the end-of-run check "
        "runs (Ctrl-C instead interrupts it, to be continued)",
    )
    p = add(
        "config",
        commands.cmd_config,
        "print the effective config, each key with where its value came from (file, "
        "environment, flag, default), as TOML a --config file can hold",
        None,
    )
    p.add_argument("--json", action="store_true", help="machine-readable: {key: {value, source}}")
    p.add_argument("--show-secrets", action="store_true", help="print the secrets too (redacted by default)")
    p = add(
        "check",
        commands.cmd_check,
        "count what exactly-once forbids in a run: groups lost, finished or trained "
        "twice, tokens generated again (exit 1 when a count that must be 0 is not)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add(
        "runs",
        commands.cmd_runs,
        "list the runs under run_dir: live, interrupted, ended or archived (the NAME.<time> "
        "folders --run reads too), with model, last version and reward, times",
        None,
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add("schema", commands.cmd_schema, "print every stream's schema (from its codec module)")
    p = add(
        "episodes",
        commands.cmd_episodes,
        "find episodes by outcome, reward, aborts, takeovers, versions spanned: one "
        "line each (ids for streamrl replay)",
    )
    p.add_argument(
        "--outcome",
        default="",
        metavar="LIST",
        help="finished,failed,truncated,running,paused,unreadable (comma-separated; default any)",
    )
    p.add_argument("--reward-below", type=float, metavar="X")
    p.add_argument("--reward-above", type=float, metavar="X")
    p.add_argument("--min-aborts", type=int, default=0, metavar="N")
    p.add_argument("--min-span", type=int, default=0, metavar="N", help="tokens from at least N policy versions")
    p.add_argument("--taken-over", action="store_true", help="continued by another worker after a crash")
    p.add_argument("--repacked", action="store_true", help="handed over in a long-tail repack")
    p.add_argument("--kind", choices=("agent", "plain"), help="agent episodes (through the gateway) or plain ones")
    p.add_argument("--sort", default="id", help="id, reward, length, span or aborts (default id)")
    p.add_argument("--desc", action="store_true", help="sort descending")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="lines shown (default 50; 0: all)")
    p.add_argument("--ids", action="store_true", help="print only the ids")
    p.add_argument("--json", action="store_true")
    p = add(
        "ui",
        commands.cmd_ui,
        "a local web app on every run under run_dir, live or ended (read-only): runs, live charts, "
        "episodes with filters, each episode token by token (docs/operations.md, streamrl ui)",
        ("where", "browser"),
    )
    p.add_argument("--port", dest="cfg_ui_port", type=int, default=argparse.SUPPRESS, help="the same as --ui-port")
    p = add(
        "redis-cli",
        commands.cmd_redis_cli,
        "run redis-cli (valkey-cli) against the run's server: streamrl redis-cli -- XRANGE ...",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="redis-cli arguments, after --")
    p = sub.add_parser(
        "keep",
        help="run one process (every Procfile line does) and start it again when it crashes "
        "(services/ops/launch/keep.py): streamrl keep -- python -m services.trainer",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command, after --")
    return parser
