"""The project's model code makes no deprecated transformers call where pyproject.toml's warning filters cannot
see it: the torch engine's prefill and decode (transformers logs the old cache names instead of warning) and the
trainer's dropout switch (``is_gradient_checkpointing`` warns as if from transformers itself, as it does when
peft reads it)."""

from __future__ import annotations

import logging
import warnings

import torch
from transformers.utils import logging as hf_logging

from services.rollout.engine.model_runner import ModelRunner
from services.trainer.model import load_policy
from services.trainer.step import no_dropout
from shared.runtime.config.keys import Config


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_engine_prefill_and_decode_use_the_current_cache_names(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir)
    # transformers' loggers do not propagate
    records, root = Records(), logging.getLogger("transformers")
    root.addHandler(records)
    # a deprecation is logged once per process: forget earlier ones
    hf_logging.warning_once.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            runner.prefill([("a", [5, 6, 7]), ("b", [8, 9])])
            runner.decode([10, 11])
            runner.prefill([("c", [12])])
            logits = runner.decode([13, 14, 15])
    finally:
        root.removeHandler(records)
    assert logits.shape[0] == 3 and runner.rows == ["a", "b", "c"] and len(runner.cache.layers) > 0
    assert [m for m in records.messages if "deprecated" in m] == []


def test_no_dropout_keeps_checkpointed_models_training_without_deprecated_calls(tiny_model_dir):
    for lora_rank in (0, 4):
        policy = load_policy(Config(model_dir=tiny_model_dir, grad_checkpointing=True, lora_rank=lora_rank))
        policy.model.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            no_dropout(policy.model)
        dropouts = [m for m in policy.model.modules() if isinstance(m, torch.nn.Dropout)]
        assert policy.model.training and all(not m.training for m in dropouts), lora_rank
