"""The trainer's policy model: how it is loaded, what runs the forward pass, and what a version publishes.

- weights are loaded in fp32 (the master copy the optimizer updates);
- ``dtype = "bfloat16"``: the forward runs under bf16 autocast (CPU, or a GPU that supports bf16); the loss
  is computed from fp32 logits and the optimizer state stays fp32;
- ``grad_checkpointing``: activations are recomputed in backward (non-reentrant checkpointing);
- ``lora_rank > 0``: PEFT LoRA adapters on ``lora_targets``; only they train. A version publishes merged
  weights (base + B·A·alpha/r) under the base model's parameter names, so both engines load it like any
  other version and nothing else in the pipeline knows LoRA is on;
- ``routing_replay`` on a mixture of experts: the forwards route each sampled token through the experts its
  behaviour policy chose (the episode log's routes, shared/runtime/moe/routers.py); the router still trains through
  the chosen experts' probabilities;
- ``kl_coef > 0``: a frozen reference (the initial model) for a KL term: with LoRA, the same model with its
  adapters switched off (no second copy); without, a second copy with ``requires_grad`` off (bf16 when
  ``dtype`` is bfloat16).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers import AutoModelForCausalLM

from services.trainer.objective import kl as klmod
from shared.protocol.episode.logprobs import token_logprobs
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.models import resolve_model
from shared.runtime.moe.routers import Routers, RoutingUnsupported


def autocast_context(device: torch.device, dtype: str):
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def check_device(device: str, dtype: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'trainer_device' (or 'device'): {device!r} requested but CUDA is not available")
    if dtype == "bfloat16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"config key 'dtype': bfloat16 autocast needs a GPU with bf16 support; {device!r} has none "
            f'(use dtype = "float32")'
        )
    return dev


class Policy:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model_dir)
        self.device = check_device(cfg.device_of("trainer"), cfg.dtype)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        if cfg.grad_checkpointing:
            # transformers >= 5.23's name
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        self.lora = cfg.lora_rank > 0
        if self.lora:
            model = _with_lora(model, cfg)
        model.to(self.device).train()
        # every forward (policy and LoRA reference) under bf16 autocast
        if cfg.dtype == "bfloat16":
            model.forward = _autocast(model.forward, self.device, cfg.dtype)
        self.model = model
        # a mixture of experts with routing_replay on: the forwards route the logged routes (step.policy_logprobs)
        self.routers = self._routers(model, cfg)
        self.route_shape = self.routers.shape if self.routers is not None else None
        self.reference = None
        if cfg.kl_coef > 0 and not self.lora:
            ref_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
            self.reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=ref_dtype).to(self.device)
            self.reference.eval().requires_grad_(False)

    @staticmethod
    def _routers(model, cfg: Config) -> Routers | None:
        """The model's routers, hooked for replay and proven to reproduce its own routing; None for a dense model
        or with routing_replay off. A router replay does not know is refused in one line."""
        if not cfg.routing_replay:
            return None
        try:
            routers = Routers.of(model)
            if routers is not None:
                routers.check_replay(model, model.config.get_text_config().vocab_size)
        except RoutingUnsupported as exc:
            raise ConfigError(f"config key 'routing_replay': model {cfg.model_dir}: {exc}") from None
        if routers is not None:
            model.route_replay = routers
        return routers

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # --- KL to the frozen reference
    @torch.no_grad()
    def reference_logprobs(self, ids, attn, targets, temperature, top_k, top_p) -> torch.Tensor:
        """log pi_ref(target) under each row's sampling transform (per-row tensors), as the policy's are."""
        if self.lora:
            with self.model.disable_adapter():
                logits = self.model(input_ids=ids, attention_mask=attn).logits
        else:
            with autocast_context(self.device, self.cfg.dtype):
                logits = self.reference(input_ids=ids, attention_mask=attn).logits
        return token_logprobs(logits[:, :-1], targets, temperature, top_k, top_p)

    def kl_penalty(self):
        """None when ``kl_coef`` is 0, else ``f(mb, logp, device)``: ``kl_coef`` × token-mean KL(policy || reference)
        over a micro-batch (services.trainer.step adds it to the loss)."""
        if self.cfg.kl_coef <= 0:
            return None

        def penalty(mb, logp, device):
            ids, attn, targets = mb.input_ids.to(device), mb.attention_mask.to(device), mb.targets.to(device)
            ref = self.reference_logprobs(
                ids, attn, targets, mb.temperature.to(device), mb.top_k.to(device), mb.top_p.to(device)
            )
            return self.cfg.kl_coef * klmod.kl_term(logp, ref, mb.loss_mask.to(device), self.cfg.kl_estimator)

        return penalty

    # --- what a version publishes
    @torch.no_grad()
    def publish_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base model's names (LoRA merged in), on CPU; a tied weight once."""
        return merged_state(self.model, self.lora)


def merged_state(model, lora: bool) -> dict[str, torch.Tensor]:
    base = model.get_base_model() if lora else model
    deltas = {}
    if lora:
        from peft.tuners.lora import LoraLayer

        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and module.active_adapters:
                adapter = module.active_adapters[0]
                if adapter in module.lora_A:
                    deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(adapter)
    state, seen = {}, set()
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        ptr = value.data_ptr()
        # a tied weight (lm_head = embeddings): the engines tie it themselves
        if ptr in seen:
            continue
        seen.add(ptr)
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        state[key.replace(".base_layer.", ".")] = value.detach().to("cpu").contiguous()
    return state


def _with_lora(model, cfg: Config):
    from peft import LoraConfig, get_peft_model

    targets = (
        "all-linear"
        if cfg.lora_targets.strip() == "all-linear"
        else [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
    )
    try:
        return get_peft_model(
            model,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                target_modules=targets,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            ),
        )
    except ValueError as exc:
        raise ConfigError(f"config key 'lora_targets': {cfg.lora_targets!r}: {str(exc).splitlines()[0]}") from None


def _autocast(forward, device: torch.device, dtype: str):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with autocast_context(device, dtype):
            return forward(*args, **kwargs)

    return wrapped


def load_policy(cfg: Config) -> Policy:
    return Policy(cfg)
