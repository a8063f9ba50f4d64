"""One flat config object for every service (nanoGPT style).

Precedence, lowest first: defaults below < TOML file (``--config`` or
``STREAMRL_CONFIG``) < environment ``STREAMRL_<KEY>`` (and ``REDIS_URL``) <
command-line flags ``--<key>``. An unknown key or a value of the wrong type is
a ConfigError naming the key, the source and the expected type.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from typing import Any, Mapping


class ConfigError(ValueError):
    pass


@dataclass
class Config:
    # where
    run: str = "demo"  # namespaces every Redis key: streamrl:<run>:...
    redis_url: str = "redis://127.0.0.1:6390/0"  # password: redis://:secret@host:port/0
    run_dir: str = "runs"  # Redis data, weights, checkpoints, metrics, plots
    log_level: str = "info"
    # episode log
    flush_tokens: int = 16  # flush an episode's buffered tokens once this many are pending
    flush_ms: float = 50.0  # ... or once the oldest pending token is this old
    # model
    model_dir: str = "models/tiny"  # HF-format causal LM folder (config, safetensors, tokenizer)
    tokenizer: str = ""  # folder for decoding text in `streamrl replay`; empty means model_dir

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in fields(Config)}


def _coerce(key: str, value: Any, source: str) -> Any:
    if key not in FIELDS:
        raise ConfigError(f"unknown config key {key!r} (from {source}); known keys: {', '.join(FIELDS)}")
    typ = FIELDS[key].type
    want = {"int": int, "float": float, "str": str, "bool": bool}[typ if isinstance(typ, str) else typ.__name__]
    if isinstance(value, str) and want is not str:
        text = value.strip().lower()
        try:
            if want is bool:
                if text not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                return text in ("1", "true", "yes")
            return want(text)
        except ValueError:
            raise ConfigError(f"config key {key!r} (from {source}): expected {want.__name__}, got {value!r}") from None
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"config key {key!r} (from {source}): expected {want.__name__}, got {value!r}")
    return value


def load(path: str | None = None, env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = path or env.get("STREAMRL_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML ({exc})") from None
        for key, value in data.items():
            values[key] = _coerce(key, value, f"file {path}")
    if "REDIS_URL" in env:
        values["redis_url"] = env["REDIS_URL"]
    for name, value in env.items():
        if name.startswith("STREAMRL_") and name != "STREAMRL_CONFIG":
            key = name.removeprefix("STREAMRL_").lower()
            values[key] = _coerce(key, value, f"environment {name}")
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, f"flag --{key.replace('_', '-')}")
    cfg = Config(**values)
    _validate(cfg)
    return cfg


def _validate(cfg: Config) -> None:
    if cfg.flush_tokens < 1:
        raise ConfigError(f"config key 'flush_tokens': expected an integer >= 1, got {cfg.flush_tokens}")
    if cfg.flush_ms < 0:
        raise ConfigError(f"config key 'flush_ms': expected a number >= 0, got {cfg.flush_ms}")
    if not cfg.run or any(c in cfg.run for c in " :*?[]"):
        raise ConfigError(f"config key 'run': expected a name without spaces, ':' or glob characters, got {cfg.run!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--<key>`` flag per config field, plus ``--config FILE``."""
    group = parser.add_argument_group("config (file < STREAMRL_<KEY> env < flags)")
    group.add_argument("--config", metavar="FILE", help="TOML file of config keys")
    for f in fields(Config):
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"cfg_{f.name}", metavar="V", default=None,
                           help=f"default {f.default!r}")


def from_args(args: argparse.Namespace) -> Config:
    overrides = {k.removeprefix("cfg_"): v for k, v in vars(args).items() if k.startswith("cfg_")}
    return load(getattr(args, "config", None), overrides=overrides)
