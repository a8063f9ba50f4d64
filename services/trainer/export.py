"""Hugging Face folders out of a run: ``<run_dir>/<run>/export/v<N>`` holds config, tokenizer (with its chat
template), generation config and safetensors of version N, loadable with ``AutoModelForCausalLM.from_pretrained``.

Made from a published version file (merged weights under the base model's names): by the trainer every
``export_every`` versions, by `streamrl run` for the last version once every process has stopped, and by
`streamrl export --version V` for any version whose file is still kept. The export folder lives in the run's
folder, which archiving moves aside but never deletes (the run's kept versions move into it as ``weights/``)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from shared.runtime.config.keys import Config
from shared.runtime.models import resolve_model
from shared.runtime.weights import chain


class ExportError(ValueError):
    pass


def export_path(cfg: Config, version: int) -> Path:
    return cfg.run_path / "export" / f"v{version}"


def weights_file(cfg: Config, version: int) -> Path:
    return cfg.weights_path / f"v{version:06d}.safetensors"


def kept_versions(cfg: Config) -> list[int]:
    """Versions whose file is here or can be made from the deltas here, and versions exported."""
    out = set()
    paths = [*cfg.weights_path.glob("v*.safetensors"), *cfg.weights_path.glob("v*.delta")]
    for path in paths + list((cfg.run_path / "export").glob("v*")):
        try:
            out.add(int(path.name.split(".")[0][1:]))
        except ValueError:
            continue
    return sorted(out)


def save_folder(model_dir: str, state: dict, out: Path, meta: dict | None = None) -> Path:
    """Write ``state`` (base-model names; a tied weight may be left out) as a complete HF folder at ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [k for k, v in model.state_dict().items() if v.is_meta]
    if unexpected or still_meta:
        raise ExportError(
            f"weights do not match the model at {model_dir}: unexpected {unexpected[:5]}, missing {still_meta[:5]}"
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(tmp))
    try:
        GenerationConfig.from_pretrained(model_dir).save_pretrained(str(tmp))
    except OSError:
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    (tmp / "streamrl.json").write_text(
        json.dumps({**(meta or {}), "base_model": str(model_dir), "time": time.time()}, indent=1)
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_version(cfg: Config, version: int, out: Path | None = None) -> Path:
    """Export version ``version`` of the run (0: the initial model) from its published file."""
    from safetensors.torch import load_file

    model_dir = resolve_model(cfg.model_dir)
    out = Path(out) if out else export_path(cfg, version)
    if version == 0:
        from transformers import AutoModelForCausalLM

        state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        return save_folder(model_dir, state, out, {"run": cfg.run, "version": 0})
    path = weights_file(cfg, version)
    # a version the trainer published as a delta: its file made from the chain
    if not path.is_file() and cfg.weights_path.is_dir() and chain.can_make(cfg.weights_path, version):
        path = chain.make(cfg.weights_path, version)
    if not path.is_file():
        if export_path(cfg, version).is_dir() and out == export_path(cfg, version):
            # exported before; its file has been pruned since
            return out
        kept = kept_versions(cfg)
        raise ExportError(
            f"version {version} of run {cfg.run!r} is not kept: no {path}; kept: "
            f"{', '.join(map(str, kept[-20:])) or 'none'} (and 0, the initial model)"
        )
    return save_folder(model_dir, load_file(str(path)), out, {"run": cfg.run, "version": version, "weights": str(path)})


def maybe_export(cfg: Config, version: int, log=None) -> Path | None:
    """The trainer's periodic export, right after publishing ``version``."""
    if not cfg.export_every or version % cfg.export_every:
        return None
    out = export_version(cfg, version)
    if log:
        log.info("exported", version=version, path=str(out))
    return out


def export_last_of(config: dict) -> str | None:
    """``export_last`` of a config given as a dict (a warm starter's ``call``): the folder, as a string."""
    out = export_last(Config(**config))
    return str(out) if out else None


def export_last(cfg: Config) -> Path | None:
    """The newest published version as an HF folder (`streamrl run`, after every process stopped)."""
    files = [v for v in kept_versions(cfg) if cfg.weights_path.is_dir() and chain.can_make(cfg.weights_path, v)]
    if not files:
        return None
    if export_path(cfg, files[-1]).is_dir():
        return export_path(cfg, files[-1])
    return export_version(cfg, files[-1])
