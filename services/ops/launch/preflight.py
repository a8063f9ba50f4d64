"""`streamrl run`'s preflight: everything that can be checked before any process starts, one line per problem.

``config_checks`` rules on values alone; the checks here need files and imports: the model and tokenizer load
(and the engine can serve the model), the dataset and eval set load with every named column, their first rows
parse and their prompts encode (a chat template when the rows are chat messages) and fit the model's context,
the reward / tool / agent specs import and are callable, LoRA targets name modules of the model, and a run that
continues keeps the routing shape its model was recorded with (dense, or so many experts, top-k and MoE layers).
Nothing is written anywhere: a run that fails here leaves no trace under ``run_dir``."""

from __future__ import annotations

import os
import sys

from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import FIELDS, Config

# prompts of each set encoded to check the chat template and the context (the first ones)
ROWS_ENCODED = 64


class PreflightError(ConfigError):
    """Problems found before the run started: the message holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def check(cfg: Config, starter_path: str | None = None) -> None:
    """Raise ``PreflightError`` with every problem found. With ``starter_path`` (a warm process starter,
    services/ops/launch/starter.py) the checks run in a process forked from it, so this one never imports torch."""
    found = _problems_in_starter(cfg, starter_path) if starter_path else None
    if found is None:
        found = problems(cfg)
    if found:
        raise PreflightError(found)


def _problems_in_starter(cfg: Config, path: str) -> list[str] | None:
    """``problems(cfg)`` computed in a process forked from the starter at ``path``; None when that gave no
    answer (the caller then checks here)."""
    from dataclasses import asdict

    from services.ops.launch import starter_client

    try:
        return list(starter_client.call(path, "services.ops.launch.preflight:problems_of", {"config": asdict(cfg)}))
    except starter_client.CallFailed:
        return None


def problems_of(config: dict) -> list[str]:
    """``problems`` of a config given as a dict (``starter_client.call``'s way in)."""
    return problems(Config(**config))


def problems(cfg: Config) -> list[str]:
    out: list[str] = []
    model = _model(cfg, out)
    out += _splits(cfg)
    sets = _data(cfg, out)
    out += _specs(cfg)
    if model is not None:
        tokenizer, config, names = model
        out += shape_problems(cfg)
        if cfg.lora_rank > 0:
            out += lora_problems(cfg.lora_targets, names, cfg.model_dir)
        # an agent writes its own messages from the task
        if sets and not cfg.agent:
            context = getattr(config.get_text_config(), "max_position_embeddings", None)
            out += _prompts(cfg, tokenizer, context, sets)
    return out


def _model(cfg: Config, out: list[str]):
    """(tokenizer, model config, module names) when the model loads (on the meta device: no weights read)."""
    from shared.runtime.models import resolve_model

    try:
        path = resolve_model(cfg.model_dir)
    except ConfigError as exc:
        out.append(str(exc))
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a model it cannot build
        out.append(f"config key 'model_dir': {cfg.model_dir!r}: the model does not load ({_first_line(exc)})")
        return None
    where = cfg.tokenizer or path
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except Exception as exc:  # noqa: BLE001
        key = "tokenizer" if cfg.tokenizer else "model_dir"
        out.append(f"config key {key!r}: {where!r}: the tokenizer does not load ({_first_line(exc)})")
        return None
    if cfg.engine == "torch":
        from services.rollout.engine import EngineError
        from services.rollout.engine.model_runner import ModelRunner

        try:
            ModelRunner._check_servable(config, cfg.model_dir)
        except EngineError as exc:
            out.append(f"config key 'model_dir': {exc}")
        except Exception as exc:  # noqa: BLE001 - a config transformers' cache cannot be built for
            out.append(f"config key 'model_dir': {cfg.model_dir!r}: its KV cache cannot be built ({_first_line(exc)})")
    return tokenizer, config, [name for name, _ in model.named_modules()]


def shape_problems(cfg: Config) -> list[str]:
    """A run that continues (its folder names it and it has not ended) on a model that routes tokens otherwise than
    the one it recorded (``runstate.model_shape``: dense or a mixture of experts, its MoE layers, experts and top-k):
    one line. Its checkpoint and episode log are of the recorded model (the routes logged to replay have its shape)."""
    from services.driver.driver import ENDED
    from shared.runtime import runstate

    # an ended run is moved aside: this one starts afresh
    if (cfg.run_path / ENDED).exists():
        return []
    try:
        was = runstate.recorded_shape(runstate.read_marker(cfg.run_path))
    # the runner reads run.json first and says what is wrong with it
    except runstate.RunStateError:
        return []
    now = runstate.model_shape(cfg.model_dir)
    if was is None or now is None or was == now:
        return []
    return [
        f"config key 'model_dir': run {cfg.run!r} was interrupted; it was made on {runstate.describe_shape(was)} "
        f"({cfg.run_path / runstate.MARKER}), and {cfg.model_dir!r} is {runstate.describe_shape(now)}: continue it "
        f"with the model it was made with, or start another with --run NAME"
    ]


def lora_problems(targets: str, module_names: list[str], model_dir: str) -> list[str]:
    """Each comma-separated LoRA target must end some module's name (PEFT's matching), else one line."""
    if targets.strip() == "all-linear":
        return []
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    missing = [t for t in wanted if not any(n == t or n.endswith("." + t) for n in module_names)]
    if not missing:
        return []
    leaves = sorted({n.rsplit(".", 1)[-1] for n in module_names if n and not n.rsplit(".", 1)[-1].isdigit()})
    return [
        f"config key 'lora_targets': {', '.join(map(repr, missing))} names no module of {model_dir!r} "
        f"(its modules: {', '.join(leaves)})"
    ]


def split_problems(dataset: str, split: str, key: str, default: str) -> list[str]:
    """A local file has one split (all its rows): a split other than the key's default names nothing there."""
    from pathlib import Path

    from services.driver.tasks import BUILTIN, FILE_KINDS

    local = dataset in BUILTIN or Path(dataset).suffix.lower() in FILE_KINDS
    if not dataset or not local or split == default:
        return []
    return [
        f"config key {key!r}: {split!r}, but {dataset!r} is a "
        f"{'built-in task' if dataset in BUILTIN else 'local file'} "
        f"with no splits (all its rows are one set); leave {key} at {default!r}"
        + (", and give the held-out rows as eval_dataset" if key == "dataset_split" else "")
    ]


def _splits(cfg: Config) -> list[str]:
    return split_problems(
        cfg.dataset, cfg.dataset_split, "dataset_split", FIELDS["dataset_split"].default
    ) + split_problems(cfg.eval_dataset, cfg.eval_split, "eval_split", FIELDS["eval_split"].default)


def _data(cfg: Config, out: list[str]) -> list[tuple[str, list[dict]]]:
    """[(config key, rows)] of the training and validation sets (each row parsed and its columns checked)."""
    from services.driver.driver import load_task

    try:
        train, held_out = load_task(cfg)
    except ValueError as exc:
        out.append(str(exc))
        return []
    return [("dataset", train), ("eval_dataset" if cfg.eval_dataset else "dataset", held_out)]


def _specs(cfg: Config) -> list[str]:
    from services.rollout.jobs import rewards, tools
    from shared.runtime import specs

    out = []
    # the services resolve specs as `python -m` does: the working directory first on sys.path (`streamrl`, a
    # console script, has its own bin folder there instead, so `examples.calc:agent` would not import here)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    loads = [lambda: rewards.load(cfg.reward_fn), lambda: tools.registry(cfg.tools)]
    if cfg.agent:
        loads.append(lambda: specs.load(cfg.agent, "agent"))
    for load in loads:
        try:
            load()
        except ValueError as exc:
            out.append(_first_line(exc))
        except Exception as exc:  # noqa: BLE001 - importing a user's module runs its code
            out.append(f"a config spec's module failed on import: {_first_line(exc)}")
    return out


def _prompts(cfg: Config, tokenizer, context: int | None, sets: list[tuple[str, list[dict]]]) -> list[str]:
    """The first prompts of each set encode (a chat template for chat rows) and leave room in the context."""
    from shared.runtime.prompt_format import PromptError, encode_prompt

    out = []
    for key, rows in sets:
        for i, row in enumerate(rows[:ROWS_ENCODED]):
            try:
                ids = encode_prompt(tokenizer, row["prompt"])
            except PromptError as exc:
                out.append(
                    f"config key {key!r}: {getattr(cfg, key)}: row {i}: {exc} "
                    f"(tokenizer {cfg.tokenizer or cfg.model_dir!r})"
                )
                break
            if context is not None and len(ids) + 1 > context:
                out.append(
                    f"config key {key!r}: {getattr(cfg, key)}: row {i}: the prompt is {len(ids)} tokens; "
                    f"the context of {cfg.model_dir!r} is {context} tokens (prompt + completion)"
                )
                break
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
