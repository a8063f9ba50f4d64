"""A run's identity, so that one run's state is never mixed with another's.

A run's state is in two places: its Redis data (streams, consumer groups) and its folder ``<run_dir>/<run>/``
(trainer snapshots and ledger, metrics, plots; by default the Redis data too, in ``redis/``). Both carry the same
identity: Redis holds ``streamrl:<run>:meta`` {run, id, created, config, model_shape, ended?}, the folder holds
``run.json`` {run, id, created, redis, config, model_shape}: ``config`` is the effective config the run was made with
(secrets left out), which commands naming ``--run`` start from; ``model_shape`` is how its model routes tokens
(:func:`model_shape`: dense, or a mixture of experts of so many MoE layers, experts and top-k), which a continuation's
model must keep (`streamrl run`'s preflight). Every process binds to the run when it has connected (``bind``): the
first one creates the identity, the others find it, and a process that finds the two disagreeing (another run's data,
or a folder whose Redis is gone: a trainer ledger ahead of an empty server) stops with one line that says what
disagrees and how to continue or start afresh."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import fields
from pathlib import Path

import redis

from shared.protocol.archive.ledger import read_ledger
from shared.protocol.episode.routes import RouteShape
from shared.protocol.keys import Keys
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.connection import redact
from shared.runtime.moe.shape import route_shape_of
from shared.runtime.secrets import private_dir

# in the run's folder: which run (id) this folder's state belongs to
MARKER = "run.json"


class RunStateError(RuntimeError):
    """The run's folder and its Redis disagree; the message says what and how to go on."""


def read_marker(run_path: Path) -> dict | None:
    try:
        return json.loads((Path(run_path) / MARKER).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise RunStateError(
            f"{Path(run_path) / MARKER}: not JSON ({exc}); it names the run this folder belongs "
            f"to: delete it only if {run_path} holds no state you want to keep"
        ) from None


def is_secret(key: str) -> bool:
    """A config key whose value is a credential: never recorded (gateway_api_key, weights_token, a *_password)."""
    parts = key.lower().split("_")
    return bool({"token", "password", "secret", "apikey"} & set(parts)) or key.lower().endswith("api_key")


def recordable(cfg: Config) -> dict:
    """The effective config as the run records it: every key but the secrets, URLs with their password hidden."""
    out = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_secret(f.name) and isinstance(value, str):
            continue
        out[f.name] = redact(value) if isinstance(value, str) and "://" in value else value
    return out


def recorded_config(meta: dict | None) -> dict:
    """The config a run recorded ({} for a run from before configs were recorded)."""
    raw = (meta or {}).get("config")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


def model_shape(model_dir: str) -> dict | None:
    """How the model at ``model_dir`` (a folder or a cached hub id) routes tokens, as a run records it:
    ``{"moe": false}``, or ``{"moe": true, "layers": L, "top_k": k, "experts": E}``; None when its config.json cannot
    be read (nothing to record or compare)."""
    from shared.runtime.models import resolve_model

    try:
        config = json.loads((Path(resolve_model(model_dir)) / "config.json").read_text())
    except (ConfigError, OSError, ValueError):
        return None
    try:
        shape = route_shape_of(config) if isinstance(config, dict) else None
    # a malformed expert config: the engine refuses it, with the field, when it loads the model
    except ValueError:
        return None
    return {"moe": True, **shape.to_dict()} if shape else {"moe": False}


def recorded_shape(meta: dict | None) -> dict | None:
    """The model shape a run recorded (:func:`model_shape`); None for a run from before shapes were recorded."""
    raw = (meta or {}).get("model_shape")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return raw if isinstance(raw, dict) else None


def describe_shape(shape: dict) -> str:
    """A recorded model shape in words: "a dense model", "a mixture of experts (2 MoE layers, top-2 of 8 experts)"."""
    if not shape.get("moe"):
        return "a dense model"
    return f"a mixture of experts ({RouteShape(shape['layers'], shape['top_k'], shape['experts']).describe()})"


def write_marker(run_path: Path, meta: dict, redis_url: str) -> None:
    """Atomic (several processes of one run write the same content at once)."""
    # 0700: the run's Redis data, snapshots and secrets are in it
    run_path = private_dir(run_path)
    tmp = run_path / f".{MARKER}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    body = {k: meta[k] for k in ("run", "id", "created") if k in meta}
    config, shape = recorded_config(meta), recorded_shape(meta)
    body = {
        **body,
        "redis": redact(redis_url),
        **({"config": config} if config else {}),
        **({"model_shape": shape} if shape else {}),
    }
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, run_path / MARKER)


def read_meta(client: redis.Redis, keys: Keys) -> dict | None:
    raw = client.hgetall(keys.meta)
    return {k.decode(): v.decode() for k, v in raw.items()} or None


def local_state(run_path: Path) -> str | None:
    """What state the folder holds without the Redis (the trainer's ledger), in words; None when none."""
    records = read_ledger(Path(run_path) / "trainer")
    if not records:
        return None
    return f"a trainer ledger at version {max(int(r.get('version', 0)) for r in records)}"


def _has_data(client: redis.Redis, keys: Keys) -> bool:
    return bool(client.exists(keys.versions, keys.prompts, keys.samples, keys.metrics, keys.driver_enqueued))


def _ident(meta: dict) -> str:
    return f"id {meta.get('id', '?')}, created {meta.get('created', '?')}"


def _create(client: redis.Redis, keys: Keys, base: dict) -> dict:
    """The first process to get here names the run; the others read what it wrote (HSETNX)."""
    pipe = client.pipeline()
    for field, value in base.items():
        pipe.hsetnx(keys.meta, field, value)
    pipe.execute()
    # on disk before anything of the run is (valkey >= 8, Redis >= 7.2); older servers: fsync within 1 s
    try:
        client.execute_command("WAITAOF", 1, 0, 2000)
    except redis.exceptions.ResponseError:
        pass
    return read_meta(client, keys)


def bind(
    client: redis.Redis, keys: Keys, run_path: Path, redis_url: str, create: bool = True, config: dict | None = None
) -> dict | None:
    """The run's identity once folder and Redis agree (created when neither has one and ``create``, with
    ``config``: :func:`recordable`, the effective config the run records, and the :func:`model_shape` of its
    ``model_dir``); RunStateError when they disagree.
    Read-only callers (``create=False``) get None for a run not yet named."""
    run_path, where, run = Path(run_path), redact(redis_url), keys.run
    fresh = f"start afresh: move {run_path} aside (or pick another --run)"
    # the folder first: whoever wrote it had already named the run in Redis
    local = read_marker(run_path)
    meta = read_meta(client, keys)
    if local and meta:
        if local.get("id") != meta.get("id"):
            raise RunStateError(
                f"run {run!r}: {run_path} belongs to run {_ident(local)} but Redis at {where} holds run "
                f"{_ident(meta)}: two different runs, not mixed; continue the folder's run on the Redis it ran on "
                f"({local.get('redis', '?')}; `streamrl redis` serves {run_path / 'redis'}), or {fresh}"
            )
        # served on another port now (`streamrl run`)
        if create and local.get("redis") != redact(redis_url):
            write_marker(run_path, {**local, **meta}, redis_url)
        return meta
    if meta:
        if local_state(run_path):
            raise RunStateError(
                f"run {run!r}: {run_path} holds {local_state(run_path)} but no {MARKER}, so it cannot be told "
                f"to belong to the run in Redis at {where} ({_ident(meta)}); {fresh}"
            )
        if create:
            write_marker(run_path, meta, redis_url)
        return meta
    has_data = _has_data(client, keys)
    if local:
        # data of the run from before its name was recorded: adopt it
        if has_data:
            adopted = {k: local[k] for k in ("run", "id", "created") if k in local}
            for field in ("config", "model_shape"):
                if local.get(field):
                    adopted[field] = json.dumps(local[field])
            return _create(client, keys, adopted) if create else local
        state = local_state(run_path)
        raise RunStateError(
            f"run {run!r}: {run_path} belongs to run {_ident(local)}{f' and holds {state}' if state else ''} but "
            f"Redis at {where} has nothing of it: serve the Redis data it ran on ({local.get('redis', '?')}; "
            f"`streamrl redis` serves {run_path / 'redis'}), or {fresh}"
        )
    state = local_state(run_path)
    if state and not has_data:
        raise RunStateError(
            f"run {run!r}: {run_path} holds {state} but Redis at {where} has nothing of run "
            f"{run!r}: serve the Redis data it ran on (`streamrl redis` serves "
            f"{run_path / 'redis'}), or {fresh}"
        )
    if not create:
        return None
    shape = model_shape(config["model_dir"]) if config and isinstance(config.get("model_dir"), str) else None
    meta = _create(
        client,
        keys,
        {
            "run": run,
            "id": uuid.uuid4().hex[:12],
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **({"config": json.dumps(config)} if config else {}),
            **({"model_shape": json.dumps(shape)} if shape else {}),
        },
    )
    write_marker(run_path, meta, redis_url)
    return meta


def mark_ended(client: redis.Redis, keys: Keys, version: int) -> None:
    client.hset(
        keys.meta, mapping={"ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ended_version": version}
    )


def request_end(client: redis.Redis, keys: Keys, by: str) -> None:
    """Ask the run's driver to end the run at its next turn, as when it reaches ``max_versions``: it stops the
    run's processes and the end-of-run check runs (``streamrl stop``). Ctrl-C instead interrupts a run, which
    continues when started again."""
    client.hset(keys.meta, "end_requested", f"{by} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")


def end_requested(client: redis.Redis, keys: Keys) -> str | None:
    """Who asked the run to end, and when; None when nobody has."""
    found = client.hget(keys.meta, "end_requested")
    return found.decode() if isinstance(found, bytes) else found


def ended(meta: dict | None) -> str | None:
    """'at version V on T' when the run was ended by its driver."""
    if not meta or not meta.get("ended"):
        return None
    return f"at version {meta.get('ended_version', '?')} on {meta['ended']}"
