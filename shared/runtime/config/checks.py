"""The config's value rules: each check names the key, what was expected and what it got (``ConfigError``).

``config_sources.load`` runs ``validate`` on every config it builds, whatever the values came from (file, environment,
flags), so a service never starts on a value it would misread. The rules are grouped by topic.
"""

from __future__ import annotations

import json
import re

from shared.protocol.streams.once import RETRY_MARKER_TTL_S
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.connection import is_cluster, redact

# the mixture-of-experts families the default tiny model comes in (model_moe; services/ops/launch/tiny_model.py)
MOE_FAMILIES = ("qwen3", "mixtral", "olmoe")


def validate(cfg: Config) -> None:
    if is_cluster(cfg.rq_redis_url):
        raise ConfigError(
            f"config key 'rq_redis_url': expected a single Redis server (rq 3 does not run on a "
            f"cluster: its worker needs one server's connection pool, its MULTIs span job and queue "
            f"keys), got the cluster URL {redact(cfg.rq_redis_url)}"
        )
    if is_cluster(cfg.redis_url) and not cfg.rq_redis_url:
        raise ConfigError(
            f"config key 'rq_redis_url': redis_url {redact(cfg.redis_url)} names a Redis Cluster and rq "
            f"needs a single server for the tool, reward and agent job queues: set rq_redis_url "
            f"(or STREAMRL_RQ_REDIS_URL) to a plain redis:// URL"
        )
    if not re.fullmatch(r"\d+(b|kb|mb|gb)?", cfg.redis_maxmemory.strip().lower()):
        raise ConfigError(
            f"config key 'redis_maxmemory': expected a size in Redis units (0: none, 512mb, 4gb), "
            f"got {cfg.redis_maxmemory!r}"
        )
    if cfg.flush_tokens < 1:
        raise ConfigError(f"config key 'flush_tokens': expected an integer >= 1, got {cfg.flush_tokens}")
    if cfg.log_retention_versions < 0:
        raise ConfigError(
            f"config key 'log_retention_versions': expected a whole number >= 0 (0: off), got "
            f"{cfg.log_retention_versions}"
        )
    if cfg.stream_keep_s < 0:
        raise ConfigError(f"config key 'stream_keep_s': expected seconds >= 0, got {cfg.stream_keep_s}")
    if cfg.archive_every_s <= 0:
        raise ConfigError(f"config key 'archive_every_s': expected seconds > 0, got {cfg.archive_every_s}")
    if cfg.archive_every_versions < 0:
        raise ConfigError(
            f"config key 'archive_every_versions': expected a whole number >= 0 (0: by archive_every_s "
            f"only), got {cfg.archive_every_versions}"
        )
    if not 0 <= cfg.archiver_nice <= 19:
        raise ConfigError(
            f"config key 'archiver_nice': expected a whole number 0..19 (os.nice; 19 the lowest "
            f"priority), got {cfg.archiver_nice}"
        )
    if cfg.flush_ms < 0:
        raise ConfigError(f"config key 'flush_ms': expected a number >= 0, got {cfg.flush_ms}")
    for key in ("max_batch_size", "max_groups_in_flight", "group_size", "max_tokens"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r}: expected an integer >= 1, got {getattr(cfg, key)}")
    if cfg.engine not in ("torch", "vllm"):
        raise ConfigError(f"config key 'engine': expected 'torch' or 'vllm', got {cfg.engine!r}")
    if cfg.model_moe not in ("", *MOE_FAMILIES):
        raise ConfigError(
            f"config key 'model_moe': expected {', '.join(map(repr, MOE_FAMILIES))} or '' (the dense default "
            f"model), got {cfg.model_moe!r}"
        )
    if cfg.vllm_args:
        try:
            vllm_args = json.loads(cfg.vllm_args)
        except ValueError as exc:
            raise ConfigError(
                f"config key 'vllm_args': expected a JSON object of vllm.EngineArgs, got {cfg.vllm_args!r} ({exc})"
            ) from None
        if not isinstance(vllm_args, dict):
            raise ConfigError(
                f"config key 'vllm_args': expected a JSON object of vllm.EngineArgs, got "
                f"{type(vllm_args).__name__} {cfg.vllm_args!r}"
            )
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1 or cfg.top_k < 0:
        raise ConfigError(
            f"config keys temperature/top_p/top_k: expected temperature >= 0, 0 < top_p <= 1, "
            f"top_k >= 0, got {cfg.temperature}, {cfg.top_p}, {cfg.top_k}"
        )
    if cfg.tool_timeout <= 0 or cfg.heartbeat_ttl <= 0 or cfg.redis_wait <= 0:
        raise ConfigError("config keys tool_timeout, heartbeat_ttl and redis_wait: expected seconds > 0")
    # a retried command must find its marker still there
    if cfg.redis_wait > RETRY_MARKER_TTL_S / 2:
        raise ConfigError(
            f"config key 'redis_wait': expected at most {RETRY_MARKER_TTL_S // 2} seconds (half the "
            f"life of the markers that make a retried control write a no-op), got {cfg.redis_wait:g}"
        )
    for key in ("batch_groups", "steps_per_version"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r}: expected an integer >= 1, got {getattr(cfg, key)}")
    for key in ("ppo_minibatches",):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r}: expected an integer >= 1, got {getattr(cfg, key)}")
    if cfg.step_delay_ms < 0 or cfg.simulated_train_us_per_token < 0 or cfg.simulated_load_ms < 0:
        raise ConfigError(
            f"config keys step_delay_ms, simulated_train_us_per_token, simulated_load_ms: expected >= 0, "
            f"got {cfg.step_delay_ms}, {cfg.simulated_train_us_per_token}, {cfg.simulated_load_ms}"
        )
    if cfg.micro_batch_tokens < 0 or cfg.hard_max_staleness < 0:
        raise ConfigError(
            f"config keys micro_batch_tokens, hard_max_staleness: expected integers >= 0, got "
            f"{cfg.micro_batch_tokens}, {cfg.hard_max_staleness}"
        )
    if cfg.is_mode not in ("mask", "truncate"):
        raise ConfigError(f"config key 'is_mode': expected 'mask' or 'truncate', got {cfg.is_mode!r}")
    if cfg.clip_ratio_c != 0 and not cfg.clip_ratio_c > 1:
        raise ConfigError(f"config key 'clip_ratio_c': expected a number > 1 (or 0: off), got {cfg.clip_ratio_c}")
    if cfg.is_cap != 0 and not cfg.is_cap >= 1:
        raise ConfigError(f"config key 'is_cap': expected a number >= 1 (or 0: off), got {cfg.is_cap}")
    if cfg.is_level not in ("token", "sequence", "geometric"):
        raise ConfigError(f"config key 'is_level': expected 'token', 'sequence' or 'geometric', got {cfg.is_level!r}")
    if cfg.icepop_beta != 0 and not cfg.icepop_beta > 1:
        raise ConfigError(f"config key 'icepop_beta': expected a number > 1 (or 0: off), got {cfg.icepop_beta}")
    if not cfg.m2po_tau >= 0:
        raise ConfigError(f"config key 'm2po_tau': expected a number > 0 (or 0: off), got {cfg.m2po_tau}")
    if cfg.loss not in ("decoupled", "ppo"):
        raise ConfigError(f"config key 'loss': expected 'decoupled' or 'ppo', got {cfg.loss!r}")
    if cfg.mode not in ("async", "sync"):
        raise ConfigError(f"config key 'mode': expected 'async' or 'sync', got {cfg.mode!r}")
    if cfg.mode == "sync" and cfg.max_staleness != 0:
        raise ConfigError(
            f"config key 'max_staleness': mode 'sync' (rollout waits for the trainer) trains every "
            f"token under the version that generated it, so it needs max_staleness = 0, got "
            f"{cfg.max_staleness}"
        )
    if cfg.max_staleness < 0:
        raise ConfigError(f"config key 'max_staleness': expected an integer >= 0, got {cfg.max_staleness}")
    if cfg.lr <= 0 or cfg.clip_low < 0 or cfg.clip_high < 0 or cfg.is_cap < 0:
        raise ConfigError("config keys lr, clip_low, clip_high, is_cap: expected lr > 0 and the others >= 0")
    if cfg.agent and ":" not in cfg.agent:
        raise ConfigError(f"config key 'agent': expected 'module:function', got {cfg.agent!r}")
    if cfg.rollout_workers < 1:
        raise ConfigError(f"config key 'rollout_workers': expected an integer >= 1, got {cfg.rollout_workers}")
    if cfg.agent_workers < 1 or cfg.agent_concurrency < 1:
        raise ConfigError(
            f"config keys agent_workers, agent_concurrency: expected integers >= 1, got "
            f"{cfg.agent_workers}, {cfg.agent_concurrency}"
        )
    if cfg.max_calls_in_flight < 1 or not 0 < cfg.gateway_port < 65536 or cfg.agent_timeout <= 0:
        raise ConfigError(
            f"config keys max_calls_in_flight, gateway_port, agent_timeout: expected an integer >= 1, "
            f"a port 1-65535 and seconds > 0, got {cfg.max_calls_in_flight}, {cfg.gateway_port}, "
            f"{cfg.agent_timeout}"
        )
    if cfg.fail_fast_groups < 0:
        raise ConfigError(
            f"config key 'fail_fast_groups': expected an integer >= 0 (0: never stop early), got {cfg.fail_fast_groups}"
        )
    if not 0 < cfg.ui_port < 65536:
        raise ConfigError(f"config key 'ui_port': expected a port 1-65535, got {cfg.ui_port}")
    if ":" not in cfg.reward_fn:
        raise ConfigError(f"config key 'reward_fn': expected 'module:function', got {cfg.reward_fn!r}")
    if cfg.val_every < 0 or cfg.val_size < 1 or not 0 <= cfg.val_fraction < 1:
        raise ConfigError(
            f"config keys val_every/val_size/val_fraction: expected val_every >= 0, val_size >= 1, "
            f"0 <= val_fraction < 1, got {cfg.val_every}, {cfg.val_size}, {cfg.val_fraction}"
        )
    if cfg.wandb not in ("", "online", "offline"):
        raise ConfigError(f"config key 'wandb': expected 'online', 'offline' or empty, got {cfg.wandb!r}")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"config key 'dtype': expected 'float32' or 'bfloat16', got {cfg.dtype!r}")
    if cfg.lora_rank < 0 or cfg.lora_alpha <= 0:
        raise ConfigError(
            f"config keys lora_rank/lora_alpha: expected lora_rank >= 0 and lora_alpha > 0, got "
            f"{cfg.lora_rank}, {cfg.lora_alpha}"
        )
    if cfg.kl_coef < 0 or cfg.kl_estimator not in ("k1", "k3"):
        raise ConfigError(
            f"config keys kl_coef/kl_estimator: expected kl_coef >= 0 and 'k1' or 'k3', got "
            f"{cfg.kl_coef}, {cfg.kl_estimator!r}"
        )
    if cfg.epochs < 0 or cfg.val_k < 1 or cfg.export_every < 0:
        raise ConfigError(
            f"config keys epochs/val_k/export_every: expected epochs >= 0, val_k >= 1, export_every >= 0, "
            f"got {cfg.epochs}, {cfg.val_k}, {cfg.export_every}"
        )
    _validate_weights_transport(cfg)
    _validate_repack(cfg)
    if not cfg.run or any(c in cfg.run for c in " :*?[]{}"):
        raise ConfigError(
            f"config key 'run': expected a name without spaces, ':', braces or glob characters, got {cfg.run!r}"
        )


def _validate_repack(cfg: Config) -> None:
    if not 0 <= cfg.longtail_workers <= cfg.rollout_workers:
        raise ConfigError(
            f"config key 'longtail_workers': expected 0 to rollout_workers ({cfg.rollout_workers}), got "
            f"{cfg.longtail_workers}"
        )
    if cfg.rollout_role not in ("normal", "longtail"):
        raise ConfigError(f"config key 'rollout_role': expected 'normal' or 'longtail', got {cfg.rollout_role!r}")
    if not 0 <= cfg.repack_below < 1:
        raise ConfigError(f"config key 'repack_below': expected a fraction 0 <= x < 1 (0: off), got {cfg.repack_below}")
    if cfg.repack_min_tokens < 1:
        raise ConfigError(f"config key 'repack_min_tokens': expected an integer >= 1, got {cfg.repack_min_tokens}")
    if not 0 <= cfg.longtail_claim_share <= 1:
        raise ConfigError(
            f"config key 'longtail_claim_share': expected a fraction 0 <= x <= 1, got {cfg.longtail_claim_share}"
        )


def _validate_weights_transport(cfg: Config) -> None:
    if cfg.weights_fetch not in ("auto", "always", "never"):
        raise ConfigError(
            f"config key 'weights_fetch': expected 'auto', 'always' or 'never', got {cfg.weights_fetch!r}"
        )
    if not 0 <= cfg.weights_port < 65536:
        raise ConfigError(
            f"config key 'weights_port': expected a port 1-65535, or 0 for no weight server, got {cfg.weights_port}"
        )
    if cfg.weights_url and not cfg.weights_url.startswith(("http://", "https://")):
        raise ConfigError(f"config key 'weights_url': expected an http:// or https:// address, got {cfg.weights_url!r}")
    if cfg.weights_port and not cfg.weights_url and cfg.weights_host in ("", "0.0.0.0", "::"):
        raise ConfigError(
            f"config key 'weights_url': weights_host {cfg.weights_host!r} listens on every interface "
            f"but is no address a worker can reach; set weights_url (e.g. http://<trainer host>:"
            f"{cfg.weights_port})"
        )
    if cfg.rollout_weights_keep < 1 or cfg.fetch_timeout <= 0:
        raise ConfigError(
            f"config keys rollout_weights_keep, fetch_timeout: expected an integer >= 1 and seconds > 0, "
            f"got {cfg.rollout_weights_keep}, {cfg.fetch_timeout}"
        )
    if cfg.publish_dtype not in ("", "bfloat16", "float16", "float32"):
        raise ConfigError(
            f"config key 'publish_dtype': expected 'bfloat16', 'float16', 'float32' or empty (as "
            f"trained), got {cfg.publish_dtype!r}"
        )
    if cfg.delta_max_chain < 0:
        raise ConfigError(
            f"config key 'delta_max_chain': expected an integer >= 0 (0: no deltas), got {cfg.delta_max_chain}"
        )
    if cfg.publish_full_every < 0:
        raise ConfigError(
            f"config key 'publish_full_every': expected an integer >= 0 (0: only when a delta cannot be), got "
            f"{cfg.publish_full_every}"
        )
    if (
        cfg.snapshot_every_versions < 0
        or cfg.snapshot_every_s < 0
        or not (cfg.snapshot_every_versions or cfg.snapshot_every_s)
    ):
        raise ConfigError(
            f"config keys snapshot_every_versions/snapshot_every_s: expected numbers >= 0, not both 0 (a restart "
            f"re-trains every version since the last snapshot), got {cfg.snapshot_every_versions}, "
            f"{cfg.snapshot_every_s}"
        )
    if cfg.snapshot_replay_s < 0:
        raise ConfigError(
            f"config key 'snapshot_replay_s': expected seconds >= 0 (0: off), got {cfg.snapshot_replay_s}"
        )
    if not 0 < cfg.delta_max_fraction <= 1:
        raise ConfigError(
            f"config key 'delta_max_fraction': expected a fraction in (0, 1], got {cfg.delta_max_fraction}"
        )
    if cfg.sync_mode not in ("global", "rolling", "pull"):
        raise ConfigError(f"config key 'sync_mode': expected 'global', 'rolling' or 'pull', got {cfg.sync_mode!r}")
    if not 0 <= cfg.pull_load_below <= 1:
        raise ConfigError(
            f"config key 'pull_load_below': expected a fraction 0-1 of a worker's slots, got {cfg.pull_load_below}"
        )
    for key in ("pull_max_wait_s", "load_lease_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config key {key!r}: expected seconds > 0, got {getattr(cfg, key)}")
    for key in ("max_loading", "relay_fanout"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key {key!r}: expected an integer >= 1, got {getattr(cfg, key)}")
    if not -1 <= cfg.relay_port < 65536:
        raise ConfigError(
            f"config key 'relay_port': expected a port 1-65535, -1 (a free one) or 0 (no relay), got {cfg.relay_port}"
        )
    if cfg.relay_port and cfg.relay_host in ("", "0.0.0.0", "::"):
        raise ConfigError(
            f"config key 'relay_host': expected an address other workers can reach (it is advertised), "
            f"got {cfg.relay_host!r}"
        )
    if cfg.rollout_weights_path.resolve() == cfg.weights_path.resolve():
        raise ConfigError(
            f"config key 'rollout_weights_dir': {cfg.rollout_weights_dir!r} is the trainer's weights_dir; "
            f"a worker's downloads (and their pruning) need a folder of their own"
        )
