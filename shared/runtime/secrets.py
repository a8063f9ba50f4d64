"""A run's secrets: one 0600 file in the run's folder, ``<run_dir>/<run>/secrets.json``, that every process of the
run reads and nothing copies anywhere else (docs/security.md).

It holds three secrets: ``redis_password`` (the embedded Redis's ``requirepass``: whoever has it can read and
write every stream of the run and enqueue jobs), ``gateway_api_key`` (the gateway's bearer key; agents get only a
per-episode key derived from it) and ``weights_token`` (the weight server's and relays' bearer token), plus
``redis_server`` (``host:port`` of the embedded server the password belongs to). ``streamrl run`` and ``streamrl
redis`` create it (``load_or_create``), keeping a value given in the config, generating the rest; every process
fills its config's empty secrets from it (``apply``, called by ``config_sources.load``). No secret travels on a
command line (``ps`` shows argv to every user); a process started by ``streamrl run`` finds the file by
``run_dir`` and ``run``. A REDIS_URL of your own with a password travels in the environment, which only the same
user (and root) can read (``/proc/<pid>/environ`` is 0400).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets as _random
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

FILE = "secrets.json"
# config keys: gateway_api_key, weights_token
SECRETS = ("redis_password", "gateway_api_key", "weights_token")
# the config keys a secret fills when empty
CONFIG_KEYS = ("gateway_api_key", "weights_token")
REDACTED = "***"


def path(run_path: str | Path) -> Path:
    return Path(run_path) / FILE


def private_dir(folder: str | Path) -> Path:
    """``folder`` made (parents too) and set to 0700: a run's folder holds its Redis data, checkpoints, secrets."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if folder.stat().st_uid == os.getuid() and folder.stat().st_mode & 0o077:
        folder.chmod(0o700)
    return folder


def read(run_path: str | Path) -> dict:
    """The run's secrets; {} when there is no file, or it is not this user's to read (another user's run)."""
    try:
        data = json.loads(path(run_path).read_text())
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return {}
    except ValueError as exc:
        raise ValueError(
            f"{path(run_path)}: not JSON ({exc}); delete it to have the run's secrets made again"
        ) from None
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def write(run_path: str | Path, data: dict) -> Path:
    """Atomically, created 0600 (never world-readable, not even for a moment), in a 0700 run folder."""
    folder = private_dir(run_path)
    tmp = folder / f".{FILE}.{os.getpid()}.{_random.token_hex(3)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path(folder))
    return path(folder)


def load_or_create(run_path: str | Path, given: dict | None = None) -> dict:
    """The run's secrets, made when missing: a value in ``given`` (the config's, non-empty) wins and is kept in
    the file, a secret the file already has stays, the rest are generated (32 bytes, URL-safe)."""
    data = read(run_path)
    changed = not path(run_path).exists()
    for key in SECRETS:
        want = (given or {}).get(key) or data.get(key) or _random.token_urlsafe(32)
        changed |= data.get(key) != want
        data[key] = want
    if (given or {}).get("redis_server") and data.get("redis_server") != given["redis_server"]:
        data["redis_server"], changed = given["redis_server"], True
    if changed:
        write(run_path, data)
    else:
        path(run_path).chmod(0o600)
    return data


def server_of(url: str) -> str:
    """``host:port`` of a redis:// URL ('' when it has none)."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname}:{parts.port}" if parts.hostname and parts.port else ""
    except ValueError:
        return ""


def with_password(url: str, password: str) -> str:
    """``url`` carrying ``password`` (a URL that has one already is returned as it is)."""
    parts = urlsplit(url)
    if parts.password or not password:
        return url
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def without_password(url: str) -> str:
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = (parts.hostname or "") + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def fill(values: dict, data: dict) -> dict:
    """Pure: the config ``values`` (redis_url, gateway_api_key, weights_token) with their empty secrets filled
    from the secrets file's ``data``: the Redis password only for the server it belongs to (``redis_server``),
    so a Redis of your own without a password is never sent one."""
    out = {}
    for key in CONFIG_KEYS:
        if not values.get(key) and data.get(key):
            out[key] = data[key]
    url = values.get("redis_url", "")
    if data.get("redis_password") and data.get("redis_server") and server_of(url) == data["redis_server"]:
        if urlsplit(url).password is None:
            out["redis_url"] = with_password(url, data["redis_password"])
    return out


def apply(cfg):
    """``cfg`` with its empty secrets filled from its run's secrets file, and which keys were (for `streamrl
    config`'s sources)."""
    try:
        changes = fill(
            {"redis_url": cfg.redis_url, "gateway_api_key": cfg.gateway_api_key, "weights_token": cfg.weights_token},
            read(cfg.run_path),
        )
    except ValueError:
        return cfg, {}
    return (cfg.replace(**changes) if changes else cfg), changes


def redacted(cfg):
    """``cfg`` with its secrets shown as ``***`` (the Redis password inside redis_url / rq_redis_url too)."""
    from shared.runtime.connection import redact

    return cfg.replace(
        **{k: REDACTED for k in CONFIG_KEYS if getattr(cfg, k)},
        redis_url=redact(cfg.redis_url),
        rq_redis_url=redact(cfg.rq_redis_url),
    )


def connect_run(cfg, wait: float | None = None):
    """(cfg, client) for the run's Redis. Under ``honcho start`` every process starts at once and ``streamrl
    redis`` may write the run's secrets after this process read its config: a refused password reads them again,
    once."""
    import redis

    from shared.runtime.connection import connect

    wait = cfg.redis_wait if wait is None else wait
    try:
        return cfg, connect(cfg.redis_url, wait=wait)
    except redis.exceptions.AuthenticationError:
        cfg = apply(cfg)[0]
        return cfg, connect(cfg.redis_url, wait=wait)


def cli_auth(url: str) -> tuple[str, dict]:
    """(``url`` without its password, environment for redis-cli): the password goes in REDISCLI_AUTH, never on
    a command line (``ps`` shows argv to every user)."""
    from urllib.parse import unquote

    password = urlsplit(url).password
    return without_password(url), ({"REDISCLI_AUTH": unquote(password)} if password else {})


def episode_key(api_key: str, episode_id: str) -> str:
    """The bearer key of one agent episode: only that episode's calls are accepted with it (an agent never holds
    the gateway's own key, so it cannot call into other episodes)."""
    mac = hmac.new(api_key.encode(), f"episode:{episode_id}".encode(), hashlib.sha256).hexdigest()
    return f"ep-{mac[:40]}"


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two secrets."""
    return hmac.compare_digest(a.encode(), b.encode())
