"""Where a model comes from: a local Hugging Face folder, or a hub id resolved through ``huggingface_hub``
(its local cache first, which is all there is offline: ``HF_HUB_OFFLINE=1``).

Every service resolves ``model_dir`` the same way, so `streamrl run`, the trainer, rollout and export agree.
Only the default folder (``models/tiny``) is ever created on the spot (by `streamrl run` or
`streamrl make-model`); anything else that does not resolve is a :class:`ModelNotFound`: one line naming
the key and what was tried."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from shared.runtime.config.errors import ConfigError

DEFAULT_MODEL_DIR = "models/tiny"


class ModelNotFound(ConfigError):
    pass


def is_default(model_dir: str) -> bool:
    return Path(model_dir) == Path(DEFAULT_MODEL_DIR)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _looks_like_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


@lru_cache(maxsize=32)
def resolve_model(name: str, key: str = "model_dir") -> str:
    """The local folder holding the model ``name`` (a folder with config.json, or a hub id found in the
    cache, or downloaded when online). Raises :class:`ModelNotFound` in one line otherwise."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    if path.is_dir():
        raise ModelNotFound(
            f"config key {key!r}: {name!r} is a folder without config.json "
            f"(expected a Hugging Face model folder: config.json, weights, tokenizer)"
        )
    tried = f"no folder {str(path.resolve())!r}"
    if not _looks_like_hub_id(name):
        raise ModelNotFound(f"config key {key!r}: {name!r} does not resolve: {tried}, and it is not a hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError):
        folder = None
        if _offline():
            raise ModelNotFound(
                f"config key {key!r}: {name!r} does not resolve: {tried}, and hub id {name!r} is "
                f"not in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
            ) from None
        try:
            folder = snapshot_download(name)
        # network, auth, no such repo: all one line
        except Exception as exc:
            raise ModelNotFound(
                f"config key {key!r}: {name!r} does not resolve: {tried}, not in the local "
                f"Hugging Face cache, and the hub said: {str(exc).splitlines()[0]}"
            ) from None
    if not (Path(folder) / "config.json").is_file():
        raise ModelNotFound(f"config key {key!r}: hub id {name!r} resolved to {folder!r}, which has no config.json")
    return str(folder)


def resolve_cfg(cfg) -> str:
    return resolve_model(cfg.model_dir, "model_dir")
