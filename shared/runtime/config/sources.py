"""Where a config's values come from, lowest first: defaults (``config.py``) < TOML file (``--config`` or
``STREAMRL_CONFIG``) < environment ``STREAMRL_<KEY>`` (and ``REDIS_URL``) < command-line flags ``--<key>``.
An unknown key or a value of the wrong type is a ConfigError naming the key, the source and the expected type;
every config built here is validated (``config_checks.validate``).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from typing import Any, Mapping

from shared.runtime import secrets
from shared.runtime.config.checks import validate
from shared.runtime.config.doc import add_arguments as _add_documented
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import FIELDS, Config


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


def load(
    path: str | None = None, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    return load_with_sources(path, env, overrides)[0]


def load_with_sources(
    path: str | None = None, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> tuple[Config, dict[str, str]]:
    """The config and, per key set by something other than its default, where it came from."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
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
            sources[key] = f"file {path}"
    if "REDIS_URL" in env:
        values["redis_url"] = env["REDIS_URL"]
        sources["redis_url"] = "environment REDIS_URL"
    for name, value in env.items():
        if name.startswith("STREAMRL_") and name != "STREAMRL_CONFIG":
            key = name.removeprefix("STREAMRL_").lower()
            values[key] = _coerce(key, value, f"environment {name}")
            sources[key] = f"environment {name}"
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, f"flag --{key.replace('_', '-')}")
            sources[key] = f"flag --{key.replace('_', '-')}"
    cfg = Config(**values)
    validate(cfg)
    # the run's secrets file fills the secrets nothing else gave
    cfg, filled = secrets.apply(cfg)
    for key in filled:
        sources[key] = f"file {secrets.path(cfg.run_path)}"
    return cfg, sources


def add_arguments(parser: argparse.ArgumentParser, shown: tuple[str, ...] | None = None) -> None:
    """One ``--<key>`` flag per config field, plus ``--config FILE``; --help lists the keys of the sections
    (the full-line comments above) whose title contains one of ``shown`` (None: all), with their descriptions."""
    _add_documented(parser, shown)


def from_args(args: argparse.Namespace, with_sources: bool = False):
    overrides = {k.removeprefix("cfg_"): v for k, v in vars(args).items() if k.startswith("cfg_")}
    loaded = load_with_sources(getattr(args, "config", None), overrides=overrides)
    return loaded if with_sources else loaded[0]
