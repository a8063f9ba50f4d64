"""The trainer loop, top to bottom:

    restore checkpoint -> loop { collect groups -> replay their streams ->
    drop too-stale -> build batch -> loss -> step -> every N steps commit }

A commit writes the weights (new version), the checkpoint (with the ids of
the groups it includes), the ledger line, then acknowledges those samples and
publishes the version. A crash anywhere replays from the last commit: groups
acknowledged are in the checkpoint, groups not acknowledged come back.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import redis
import torch
from transformers import AutoModelForCausalLM

from services.trainer import checkpoint, publish
from shared.protocol import dead_letters, gate, ledger, samples
from shared.protocol.metrics import record as record_metrics
from services.trainer.batch import Batch, build_batch
from services.trainer.loss import decoupled_ppo_loss, entropy_from_logits, ppo_clip_loss, token_logprobs
from shared.runtime.config import Config
from shared.protocol.episode_log import EpisodeLog
from shared.protocol.events import EventError
from shared.protocol.fold import Episode, fold
from shared.protocol.keys import TRAINER_GROUP as GROUP, Keys
from shared.protocol.staleness import is_too_stale, staleness_histogram
from shared.runtime.tensorboard import TensorBoard

CONSUMER = "trainer"  # one trainer per run: a stable name gets its own pending entries back after a restart


class Trainer:
    def __init__(self, cfg: Config, client: redis.Redis, log):
        self.cfg, self.client, self.log = cfg, client, log
        self.keys = Keys(cfg.run)
        self.episodes = EpisodeLog(client, self.keys, "trainer")
        self.ckpt_dir = cfg.run_path / "trainer"
        self.weights_dir = cfg.weights_path
        self.metrics_path = cfg.run_path / "metrics.jsonl"
        self.tensorboard = TensorBoard(cfg, "trainer")
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, torch_dtype=torch.float32)
        self.model.to(cfg.device).train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.step, self.version = 0, 0
        self.consumed: set[str] = set()  # group ids included in the last checkpoint
        self.uncommitted: list[tuple[str, str, bool]] = []  # (samples entry, group id, trained?) since the last commit
        self.buffer: list[tuple[str, str, list[str]]] = []  # (entry id, group id, episode ids) not yet trained
        self.taken: dict[str, str] = {}  # group id -> samples entry, for groups read but not yet committed
        self._next_version_check = 0.0
        self.stale_dropped = 0
        self.wait_s = 0.0

    # --- startup
    def restore(self) -> None:
        state = checkpoint.load(self.ckpt_dir)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            self.step, self.version = state["step"], state["version"]
            self.consumed = set(state["consumed"])
            self.stale_dropped = state.get("stale_dropped", 0)
            self.log.info("restored checkpoint", step=self.step, version=self.version, consumed=len(self.consumed))
        try:
            self.client.xgroup_create(self.keys.samples, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._republish_if_needed()
        self._read(pending=True)  # entries delivered before a crash come back first

    def _republish_if_needed(self) -> None:
        """A crash between checkpoint and publish leaves the version unpublished."""
        if self.version > 0 and publish.latest_version(self.client, self.keys) < self.version:
            path, digest = publish.write_weights(self.model, self.weights_dir, self.version)
            publish.publish(self.client, self.keys, self.version, path, digest, self.step)
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
            publish.publish(self.client, self.keys, self.version, path, publish.sha256(path), self.step)
            self.log.warning("version event lost by Redis; published again", version=self.version)

    # --- reading samples
    def _read(self, pending: bool = False, block_ms: int | None = None) -> int:
        reply = self.client.xreadgroup(GROUP, CONSUMER, {self.keys.samples: "0" if pending else ">"},
                                       count=100, block=block_ms)
        added = 0
        acks = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                entry_id = entry_id.decode()
                try:
                    sample = samples.decode(entry_id, fields)
                except EventError as exc:
                    self._dead_letter(entry_id, str(exc))
                    acks.append(entry_id)
                    continue
                group_id, eids = sample.group_id, sample.episodes
                if group_id in self.consumed or group_id in self.taken:
                    # already trained, or in hand since the last commit: exactly once. The very entry in hand
                    # can come again when Redis restarts and forgets its delivery: it stays unacknowledged
                    if self.taken.get(group_id) != entry_id:
                        acks.append(entry_id)
                else:
                    self.buffer.append((entry_id, group_id, eids))
                    self.taken[group_id] = entry_id
                    added += 1
        if acks:
            self.client.xack(self.keys.samples, GROUP, *acks)
        return added

    def _dead_letter(self, entry_id: str, reason: str) -> None:
        self.log.error("bad samples entry sent to dead letters", entry=entry_id, reason=reason)
        dead_letters.send(self.client, self.keys, self.keys.samples, entry_id, reason, "trainer")

    def collect(self, should_stop) -> list[tuple[str, str, list[Episode]]] | None:
        """Block until ``batch_groups`` trainable groups are ready; replay their streams."""
        ready: list[tuple[str, str, list[Episode]]] = []
        t0 = time.monotonic()
        while len(ready) < self.cfg.batch_groups:
            if not self.buffer:
                if should_stop():
                    return None
                if not self._read(block_ms=200):
                    self._settle_skipped()
                    self._republish_if_lost()
                continue
            entry_id, group_id, eids = self.buffer.pop(0)
            group = self._replay_group(entry_id, group_id, eids)
            if group is not None:
                ready.append((entry_id, group_id, group))
        self.wait_s = time.monotonic() - t0
        return ready

    def _replay_group(self, entry_id: str, group_id: str, eids: list[str]) -> list[Episode] | None:
        episodes = []
        for eid in eids:
            try:
                ep = fold(self.episodes.read(eid))
            except EventError as exc:
                self.log.error("episode stream unreadable; episode skipped", episode=eid, error=str(exc))
                continue
            if ep.status == "finished" and ep.num_generated > 0:
                episodes.append(ep)
        versions = [v for ep in episodes for v in ep.versions]
        if not episodes or is_too_stale(self.version, versions, self.cfg.max_staleness):
            reason = "too stale" if episodes else "no finished episodes"
            self.stale_dropped += bool(episodes)
            self.log.warning("group not trained", group=group_id, reason=reason, trainer_version=self.version,
                             oldest=min((v for v in versions if v >= 0), default=None))
            self.uncommitted.append((entry_id, group_id, False))  # acknowledged with the next commit, never trained
            # give its start back to the staleness gate (which counts starts): a replacement group may start.
            # Without it a synchronous run (exactly batch_groups starts per version) would wait forever.
            gate.refund_group(self.client, self.keys, group_id)
            return None
        return episodes

    # --- learning
    def train_step(self, groups: list[tuple[str, str, list[Episode]]]) -> dict:
        t0 = time.monotonic()
        batch = build_batch([eps for _, _, eps in groups], self.pad_id)
        dev = self.cfg.device
        ids, attn, targets = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.targets.to(dev)
        mask, behav, adv = batch.loss_mask.to(dev), batch.behav_logp.to(dev), batch.advantages.to(dev)
        temp = batch.temperature.to(dev)[:, None, None]
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temp
        logp = token_logprobs(logits, targets)
        if self.cfg.loss == "decoupled":
            loss, stats = decoupled_ppo_loss(logp, logp.detach(), behav, adv, mask, self.cfg.clip_low,
                                             self.cfg.clip_high, self.cfg.is_cap or None, self.cfg.agg)
        else:
            loss, stats = ppo_clip_loss(logp, behav, adv, mask, self.cfg.clip_low, self.cfg.clip_high, self.cfg.agg)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.step += 1
        self.uncommitted += [(e, g, True) for e, g, _ in groups]
        with torch.no_grad():
            entropy = float(entropy_from_logits(logits.detach(), mask))
        return self._metrics(batch, groups, float(loss.detach()), float(grad_norm), entropy, stats, time.monotonic() - t0)

    def _metrics(self, batch: Batch, groups, loss, grad_norm, entropy, stats, seconds) -> dict:
        eps = [ep for _, _, g in groups for ep in g]
        hist = staleness_histogram(self.version, [ep.versions for ep in eps])
        lengths = torch.tensor([float(ep.num_generated) for ep in eps])
        return {"step": self.step, "version": self.version, "time": time.time(), "loss": loss,
                "reward_mean": float(batch.rewards.mean()), "reward_std": float(batch.rewards.std(unbiased=False)),
                "response_len": float(lengths.mean()), "samples": len(eps), "groups": len(groups),
                "tokens": batch.num_tokens, "tokens_per_s": batch.num_tokens / max(seconds, 1e-9),
                "wait_s": self.wait_s, "train_s": seconds, "grad_norm": grad_norm, "entropy": entropy,
                "staleness": {str(k): v for k, v in sorted(hist.items())},
                "staleness_max": max(hist, default=0), "stale_dropped": self.stale_dropped, **stats}

    def record(self, metrics: dict) -> None:
        self.tensorboard.scalars("train", metrics, metrics["step"])
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        record_metrics(self.client, self.keys, "train", metrics)
        self.log.info("step", step=metrics["step"], version=metrics["version"], reward=round(metrics["reward_mean"], 3),
                      loss=round(metrics["loss"], 4), tokens_per_s=round(metrics["tokens_per_s"]),
                      staleness_max=metrics["staleness_max"])

    # --- committing
    def commit(self) -> None:
        """New version: weights, checkpoint, ledger, ack, publish — in that order."""
        self.version += 1
        path, digest = publish.write_weights(self.model, self.weights_dir, self.version)
        trained = [g for _, g, t in self.uncommitted if t]
        skipped = [g for _, g, t in self.uncommitted if not t]
        self.consumed.update(trained + skipped)
        for g in trained + skipped:
            self.taken.pop(g, None)
        checkpoint.save(self.ckpt_dir, {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                                        "rng": torch.get_rng_state(), "step": self.step, "version": self.version,
                                        "consumed": sorted(self.consumed), "stale_dropped": self.stale_dropped})
        ledger.append_ledger(self.ckpt_dir, {"version": self.version, "step": self.step, "groups": trained,
                                                 "skipped": skipped})
        if self.uncommitted:
            self.client.xack(self.keys.samples, GROUP, *[e for e, _, _ in self.uncommitted])
        self.uncommitted = []
        publish.publish(self.client, self.keys, self.version, path, digest, self.step)
        publish.prune(self.weights_dir, keep_from=self.version - self.cfg.max_staleness - 2)
        self.log.info("version published", version=self.version, path=str(path), sha256=digest[:12])

    def _settle_skipped(self) -> None:
        """Acknowledge groups judged untrainable when no training step is pending to carry them: a
        skipped group is never trained, so its acknowledgement needs no checkpoint; it stays in its stream."""
        if not self.uncommitted or any(trained for _, _, trained in self.uncommitted):
            return
        skipped = [g for _, g, _ in self.uncommitted]
        ledger.append_ledger(self.ckpt_dir, {"version": self.version, "step": self.step, "groups": [],
                                                 "skipped": skipped})
        self.consumed.update(skipped)
        for g in skipped:
            self.taken.pop(g, None)
        self.client.xack(self.keys.samples, GROUP, *[e for e, _, _ in self.uncommitted])
        self.uncommitted = []

    def run(self, should_stop=lambda: False) -> None:
        self.restore()
        while not should_stop():
            groups = self.collect(should_stop)
            if groups is None:
                break
            self.record(self.train_step(groups))
            if self.step % self.cfg.steps_per_version == 0:
                self.commit()
