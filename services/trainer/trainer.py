"""The trainer loop, top to bottom:

    restore checkpoint (and repair the ledger) -> re-read every pending entry -> loop {
      collect groups, replay their streams (services/trainer/intake.py) -> build batch
      -> step (services/trainer/step.py) -> every N steps commit (services/trainer/commit.py) }

Staleness is bounded at admission (the gate: shared/protocol/staleness.py ``group_capacity``); a
finished group is not dropped for being stale: its tokens train with the importance weight of the
decoupled loss, and only tokens past ``hard_max_staleness`` (0: none) are masked out, counted.
A commit writes the weights (new version), the checkpoint (with the ids of the groups it includes
and its ledger line), the ledger line, then acknowledges those samples and publishes the version.
A crash anywhere replays from the last commit: groups acknowledged are in the checkpoint, groups
not acknowledged come back.

Under torchrun (services/trainer/distributed.py) this loop runs on rank 0, which sends each step's batch and
each commit to the other ranks; they ``follow``: train their share of each batch (FSDP2) and join the
commit's collectives (the full weights for the version file, the sharded checkpoint).
"""

from __future__ import annotations

import json
import time

import redis
import torch

from services.trainer import checkpoint, distributed, export, publish, topology
from services.trainer import commit as commit_path
from services.trainer.batch import Batch, build_batch
from services.trainer.deltas import DeltaWriter
from services.trainer.intake import Intake
from services.trainer.model import load_policy
from services.trainer.step import StepConfig, train_on_batch
from shared.protocol.archive import ledger
from shared.protocol.episode.fold import Episode
from shared.protocol.keys import TRAINER_GROUP as GROUP
from shared.protocol.keys import Keys
from shared.protocol.staleness import staleness_histogram, version_spans
from shared.protocol.streams import codec, stream_head
from shared.protocol.streams.metrics import record as record_metrics
from shared.runtime.config.keys import Config
from shared.runtime.faults import crash_point
from shared.runtime.folders import private_folder
from shared.runtime.runstate import bind
from shared.runtime.tensorboard import TensorBoard

# cumulative counts, kept in the checkpoint and reported with every step (docs/training.md)
COUNTERS = (
    "groups_dropped",
    "constant_groups_filtered",
    "episodes_failed",
    "policy_failures",
    "greedy_tokens",
    "stale_tokens_masked",
    "is_masked_tokens",
    "tokens_wasted",
    "nonfinite_skipped",
)


class Trainer:
    def __init__(self, cfg: Config, client: redis.Redis, log):
        self.cfg, self.client, self.log = cfg, client, log
        self.keys = Keys(cfg.run)
        self.ckpt_dir = cfg.run_path / "trainer"
        # per user and run id, 0700
        self.weights_dir = private_folder(cfg.weights_path, "weights_dir")
        self.metrics_path = cfg.run_path / "metrics.jsonl"
        # acked and committed: out
        self.samples_head = stream_head.for_run(client, self.keys.samples, GROUP, cfg)
        # one process, or one of WORLD_SIZE ranks under torchrun (topology.py), chosen once
        self.topology = topology.choose(cfg)
        self.shard = self.topology.shard
        cfg, log = self.cfg, self.log = self.topology.bind(cfg, log)
        self.tensorboard = TensorBoard(cfg, "trainer") if self.shard.main else None
        torch.manual_seed(cfg.seed)
        # device, bf16 autocast, grad checkpointing, LoRA, KL reference: model.py
        self.policy = load_policy(cfg)
        self.model = self.policy.model
        self.topology.prepare(self.model)
        self.pad_id = self.model.config.pad_token_id or 0
        self.opt = torch.optim.AdamW(self.policy.trainable_parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.step, self.version = 0, 0
        self._next_version_check = 0.0
        self.counts = dict.fromkeys(COUNTERS, 0)
        # samples, exactly once
        self.intake = Intake(client, self.keys, self.counts, cfg.filter_constant_groups, log)
        self.wait_s = 0.0
        # time in commits since the last metrics record (reported with the next step)
        self.commit_s = 0.0
        # each version's delta, in a thread
        self.deltas = DeltaWriter(cfg, client, self.keys, self.weights_dir, log)

    # --- startup
    def restore(self) -> None:
        # this folder's checkpoint and the Redis are the same run, or RunStateError (one line) before anything is mixed
        bind(self.client, self.keys, self.cfg.run_path, self.cfg.redis_url)
        state = self._load_checkpoint()
        commit_path.restore_ledger(self.ckpt_dir, state, self.log)
        if state is not None:
            self.counts.update(state.get("counts", {}))
        # every group trained or judged untrainable: the ledger's lines (now level with the checkpoint), plus the
        # list older checkpoints carried themselves
        self.intake.consumed = set((state or {}).get("consumed", ())) | {
            g for rec in ledger.read_ledger(self.ckpt_dir) for g in rec["groups"] + rec["skipped"]
        }
        codec.ensure_group(self.client, self.keys.samples, GROUP)
        self.log.info("groups already consumed, from the ledger", groups=len(self.intake.consumed))
        self._republish_if_needed()
        pages = self.intake.read_pending()
        self.log.info("pending entries re-read", pages=pages, buffered=len(self.intake.buffer))

    def _load_checkpoint(self) -> dict | None:
        """Model, optimizer, RNG, step and version from the last commit (every rank, under torchrun)."""
        state = self.topology.load(self.ckpt_dir, self.model, self.opt)
        if state is not None:
            # killed before the background write landed
            if state["optimizer_version"] != state["version"]:
                self.log.warning(
                    "optimizer state older than the model: AdamW moments from an earlier version",
                    model_version=state["version"],
                    optimizer_version=state["optimizer_version"],
                )
            self.step, self.version = state["step"], state["version"]
            self.log.info("restored checkpoint", step=self.step, version=self.version)
        return state

    def _tell(self, message: dict) -> None:
        """Rank 0: send the other ranks their next command (nothing when alone, nor on the other ranks)."""
        self.topology.tell(message)

    def _publish_state(self) -> dict:
        """The full weights a version publishes; under torchrun gathered to rank 0 (every rank calls this)."""
        return self.topology.publish_state(self.policy)

    def _republish_if_needed(self) -> None:
        """A crash between checkpoint and publish leaves the version unpublished."""
        if self.version > 0 and publish.latest_version(self.client, self.keys) < self.version:
            self._tell({"op": "gather"})
            path, digest = publish.write_weights(
                self._publish_state(), self.weights_dir, self.version, self.cfg.publish_dtype
            )
            publish.publish(self.client, self.keys, self.version, path, digest, self.step, self.cfg.weights_base_url)
            self.log.info("republished version after restart", version=self.version)

    def _republish_if_lost(self) -> None:
        """While idle, every 2 s: a Redis restart that lost its last second can lose the newest version
        event, and then nobody syncs it (the staleness gate stays at the old version and rollout waits for
        a version that never comes). Publish the committed file again when the stream is behind."""
        now = time.monotonic()
        if now < self._next_version_check or self.version == 0:
            return
        self._next_version_check = now + 2.0
        path = self.weights_dir / f"v{self.version:06d}.safetensors"
        if publish.latest_version(self.client, self.keys) < self.version and path.exists():
            publish.publish(
                self.client, self.keys, self.version, path, publish.sha256(path), self.step, self.cfg.weights_base_url
            )
            self.log.warning("version event lost by Redis; published again", version=self.version)

    # --- reading samples (services/trainer/intake.py)
    def collect(self, should_stop) -> list[tuple[str, str, list[Episode]]] | None:
        """Block until ``batch_groups`` trainable groups are ready; replay their streams."""
        t0 = time.monotonic()
        ready = self.intake.collect(self.cfg.batch_groups, should_stop, self._idle)
        self.wait_s = time.monotonic() - t0
        return ready

    def _idle(self) -> None:
        """No new samples for 200 ms."""
        self.intake.settle_skipped(self.ckpt_dir, self.version, self.step)
        self._republish_if_lost()
        self.topology.keep_alive()

    # --- learning
    def train_step(self, groups: list[tuple[str, str, list[Episode]]]) -> dict:
        t0 = time.monotonic()
        batch = build_batch([eps for _, _, eps in groups], self.pad_id, self.version, self.cfg.hard_max_staleness)
        # every rank gets the batch's ids and tensors (nothing to share when alone)
        self.topology.share_batch(groups, batch)
        stats = self._train(batch)
        # benchmarks: a SIMULATED GPU's training time, not real work
        if self.cfg.simulated_train_us_per_token:
            time.sleep(batch.num_tokens * self.cfg.simulated_train_us_per_token / 1e6)
        self.step += 1
        # every optimizer step non-finite: the groups count as not trained
        trained = stats["ppo_steps"] > 0
        self.intake.trained(groups, trained)
        if stats["nonfinite_skipped"]:
            self.log.error(
                "non-finite loss or grad norm: optimizer step skipped",
                step=self.step,
                skipped=stats["nonfinite_skipped"],
                loss=stats["loss"],
                grad_norm=stats["grad_norm"],
            )
        masked = round(stats["is_masked_fraction"] * batch.num_tokens)
        for key, value in (
            ("policy_failures", batch.policy_failures),
            ("greedy_tokens", batch.greedy_tokens),
            ("stale_tokens_masked", batch.stale_tokens_masked),
            ("is_masked_tokens", masked),
            ("tokens_wasted", batch.greedy_tokens + batch.stale_tokens_masked + masked),
            ("nonfinite_skipped", stats["nonfinite_skipped"]),
        ):
            self.counts[key] += value
        return self._metrics(batch, groups, stats, time.monotonic() - t0)

    def _train(self, batch: Batch) -> dict:
        return train_on_batch(
            self.model,
            self.opt,
            batch,
            StepConfig.from_config(self.cfg),
            self.policy.device,
            kl=self.policy.kl_penalty(),
            shard=self.shard,
        )

    def _metrics(self, batch: Batch, groups, stats: dict, seconds: float) -> dict:
        eps = [ep for _, _, g in groups for ep in g]
        hist = staleness_histogram(self.version, [ep.versions for ep in eps])
        lengths = torch.tensor([float(ep.num_generated) for ep in eps])
        return {
            "step": self.step,
            "version": self.version,
            "time": time.time(),
            "reward_mean": float(batch.rewards.mean()),
            "reward_std": float(batch.rewards.std(unbiased=False)),
            "response_len": float(lengths.mean()),
            "samples": len(eps),
            "groups": len(groups),
            "tokens": batch.num_tokens,
            "tokens_per_s": batch.num_tokens / max(seconds, 1e-9),
            "wait_s": self.wait_s,
            "train_s": seconds,
            "commit_s": self.commit_s,
            "batch_policy_failures": batch.policy_failures,
            "staleness": {str(k): v for k, v in sorted(hist.items())},
            "staleness_max": max(hist, default=0),
            "stale_dropped": self.counts["groups_dropped"],
            **version_spans(eps),
            **stats,
            **self.counts,
        }

    def record(self, metrics: dict) -> None:
        self.commit_s = 0.0
        self.tensorboard.scalars("train", metrics, metrics["step"])
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        record_metrics(self.client, self.keys, "train", metrics)
        self.log.info(
            "step",
            step=metrics["step"],
            version=metrics["version"],
            reward=round(metrics["reward_mean"], 3),
            loss=round(metrics["loss"], 4),
            tokens_per_s=round(metrics["tokens_per_s"]),
            clip_fraction=round(metrics["clip_fraction"], 4),
            staleness_max=metrics["staleness_max"],
        )

    # --- committing
    def commit(self) -> None:
        """New version: weights, checkpoint, ledger, ack, publish — in that order (services/trainer/commit.py).
        Under torchrun every rank runs it (rank 0 sends ``commit``) up to the checkpoint; the rest is rank 0's."""
        self._tell({"op": "commit"})
        if not distributed.all_finite(self.model, self.shard):
            raise RuntimeError("non-finite model weights: refusing to checkpoint or publish them")
        self.version += 1
        fault = lambda point: crash_point("trainer", point)  # noqa: E731 (tests only: shared/runtime/faults.py)
        weights = self._publish_state()
        trained, skipped = self.intake.to_commit()
        if self.shard.main:
            path, digest = publish.write_weights(weights, self.weights_dir, self.version, self.cfg.publish_dtype)
            # off the critical path: workers may fetch deltas
            self.deltas.submit(self.version, path, digest)
        self.intake.committed(trained + skipped)
        line = commit_path.record(self.version, self.step, trained, skipped)
        fault("before_checkpoint")
        # the groups trained so far are the ledger's lines plus this commit's (restore rebuilds the set from
        # them), so the checkpoint does not grow with the run
        meta = {"step": self.step, "version": self.version, "counts": dict(self.counts), "ledger_record": line}
        # alone: checkpoint.pt, its optimizer in the background; ranks: each writes its part (sharded_checkpoint.py)
        self.topology.save(self.ckpt_dir, self.model, self.opt, meta)
        fault("after_checkpoint")
        if not self.shard.main:
            return
        ledger.append_ledger(self.ckpt_dir, line)
        fault("after_ledger")
        self.intake.acknowledge()
        fault("after_ack")
        publish.publish(self.client, self.keys, self.version, path, digest, self.step, self.cfg.weights_base_url)
        fault("after_publish")
        # what no commit can need again leaves Redis
        self.samples_head.maybe_trim()
        publish.prune(self.weights_dir, keep_from=self.version - self.cfg.max_staleness - 2)
        # every export_every versions: an HF folder
        export.maybe_export(self.cfg, self.version, self.log)
        self.log.info("version published", version=self.version, path=str(path), sha256=digest[:12])

    def run(self, should_stop=lambda: False) -> None:
        if not self.shard.main:
            return self.follow()
        self.restore()
        try:
            while not should_stop():
                groups = self.collect(should_stop)
                if groups is None:
                    break
                self.record(self.train_step(groups))
                crash_point("trainer", "stepped")
                if self.step % self.cfg.steps_per_version == 0:
                    t0 = time.monotonic()
                    self.commit()
                    self.commit_s += time.monotonic() - t0
            # a warm stop: the other ranks return too
            self._tell({"op": "stop"})
        finally:
            # the last optimizer write lands before a warm stop returns
            checkpoint.wait()

    def follow(self) -> None:
        """A rank other than 0 under torchrun: restore from the last commit, then do what rank 0 says."""
        self._load_checkpoint()
        while (message := distributed.broadcast(self.shard))["op"] != "stop":
            if message["op"] == "step":
                self._train(distributed.broadcast_batch(self.shard, message))
                self.step += 1
            elif message["op"] == "commit":
                self.commit()
            elif message["op"] == "gather":
                self._publish_state()
            # "idle": rank 0 is waiting for samples
        self.log.info("rank 0 stopped; this rank stops with it", step=self.step, version=self.version)
