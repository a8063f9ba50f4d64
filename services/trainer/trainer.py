"""The trainer loop, top to bottom:

    restore: the newest snapshot, then re-train the ledger's commits after it from the episode log
      (services/trainer/state/replay.py) -> re-read every pending entry -> loop {
      collect groups, replay their streams (services/trainer/intake.py) -> build batch
      -> step (services/trainer/step.py) -> every N steps commit (services/trainer/state/commit.py) }

Staleness is bounded at admission (the gate: shared/protocol/staleness.py ``group_capacity``); a
finished group is not dropped for being stale: its tokens train with the importance weight of the
decoupled loss, and only tokens past ``hard_max_staleness`` (0: none) are masked out, counted.
A commit appends the version's ledger line (fsynced: the groups each step trained, in order), acknowledges those
samples, hands the version's weights to the publisher's thread (a delta against the version before, then the version
event: services/trainer/publisher.py) and, when one falls due (services/trainer/state/snapshot.py: by versions, by
seconds, or once the steps since the last took ``snapshot_replay_s`` to train), snapshots model, optimizer and RNG in
the background. A crash anywhere restores the newest snapshot and trains the commits after it again, from the log:
groups in the ledger are trained once, groups not in it come back.

Under torchrun (services/trainer/distributed.py) this loop runs on rank 0, which sends each step's batch and
each commit to the other ranks; they ``follow``: train their share of each batch (FSDP2) and join the
commit's collectives (the full weights a version publishes, the sharded snapshot).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import redis
import torch

from services.trainer import distributed, publish, topology
from services.trainer.batch import Batch, build_batch
from services.trainer.intake import Intake
from services.trainer.model import load_policy
from services.trainer.publisher import Publisher
from services.trainer.state import commit as commit_path
from services.trainer.state import replay
from services.trainer.state.snapshot import Snapshots
from services.trainer.step import StepConfig, train_on_batch
from shared.protocol.archive import jsonl, ledger, segments
from shared.protocol.episode.fold import Episode
from shared.protocol.keys import TRAINER_GROUP as GROUP
from shared.protocol.keys import Keys
from shared.protocol.staleness import staleness_histogram, version_spans
from shared.protocol.streams import codec, stream_head, versions
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
        # a re-trained version hashes as it was published (docs/faults.md: what it costs on a GPU)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
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
        # samples, exactly once; a committed group's episodes from either tier of the log
        archive = segments.SegmentStore(segments.folder_of(cfg.run_path))
        self.intake = Intake(
            client,
            self.keys,
            self.counts,
            cfg.filter_constant_groups,
            log,
            archive=archive,
            route_shape=self.policy.route_shape,
        )
        # each step's groups since the last commit, as its ledger line keeps them
        self.batches: list[list] = []
        self.wait_s = 0.0
        # time in commits since the last metrics record (reported with the next step)
        self.commit_s = 0.0
        # model, optimizer, RNG every snapshot_every_versions, in the background
        self.snapshots = Snapshots(
            self.ckpt_dir,
            cfg.snapshot_every_versions,
            cfg.snapshot_every_s,
            log,
            on_landed=self._snapshot_landed,
            replay_s=cfg.snapshot_replay_s,
        )
        # each version's delta (or full file) and version event, in a thread
        self.publisher = Publisher(cfg, client, self.keys, self.weights_dir, log)

    # --- startup
    def restore(self) -> None:
        # this folder's snapshots and the Redis are the same run, or RunStateError (one line) before anything is mixed
        bind(self.client, self.keys, self.cfg.run_path, self.cfg.redis_url)
        commit_path.repair(self.ckpt_dir, self.log)
        state = self._load_snapshot()
        records = ledger.read_ledger(self.ckpt_dir)
        # every group trained or judged untrainable: the ledger's lines (plus the list a checkpoint of the oldest
        # format carried itself)
        self.intake.consumed = set((state or {}).get("consumed", ())) | {
            g for rec in records for g in rec["groups"] + rec["skipped"]
        }
        codec.ensure_group(self.client, self.keys.samples, GROUP)
        self.log.info("groups already consumed, from the ledger", groups=len(self.intake.consumed))
        self._replay(records)
        # a run's first start, or a crash before its first snapshot landed: the state every later restore starts
        # from, on disk before the first step (once per run)
        if state is None:
            self._tell({"op": "snapshot", "wait": True})
            self._snapshot()
            self.topology.land(self.snapshots, wait=True)
        pages = self.intake.read_pending()
        self.log.info("pending entries re-read", pages=pages, buffered=len(self.intake.buffer))

    def _load_snapshot(self) -> dict | None:
        """Model, optimizer, RNG, step, version and counters from the newest snapshot (every rank, under torchrun)."""
        state = self.topology.load(self.ckpt_dir, self.model, self.opt)
        if state is not None:
            if state.get("optimizer", True) is None:
                self.log.warning(
                    "snapshot without optimizer state: AdamW moments start from zero", version=state["version"]
                )
            self.step, self.version = state["step"], state["version"]
            self.counts.update(state.get("counts", {}))
            self.snapshots.restored(self.version)
            self.log.info("restored snapshot", step=self.step, version=self.version)
        return state

    def _replay(self, records: list[dict]) -> None:
        """Rank 0: train the ledger's commits after the snapshot again, from the log; hash each re-derived version
        against the sha256 its version event holds; publish the versions the stream never got."""
        lines = replay.commits_after(records, self.version)
        if not lines:
            return
        t0, since = time.monotonic(), self.version
        self.log.info(
            "re-training the versions after the snapshot from the episode log", snapshot=since, versions=len(lines)
        )
        published = {v.version: v.sha256 for v in versions.read_all(self.client, self.keys, self.cfg.run_path)}
        latest = max(published, default=0)
        replayed, differing, republished = [], [], []
        for line in lines:
            for step in replay.steps_of(line):
                self._learn(self.intake.refold(step))
            if self.step != line["step"]:
                self.log.warning(
                    "re-trained commit ends at another step",
                    version=line["version"],
                    step=self.step,
                    ledger_step=line["step"],
                )
            self.version = line["version"]
            self._tell({"op": "gather", "version": self.version})
            weights = publish.frozen(self._publish_state(), self.cfg.publish_dtype)
            replayed.append(self.version)
            if self.version > latest:
                # never published (a crash before its event): published now
                self.publisher.submit(self.version, self.step, weights)
                republished.append(self.version)
                continue
            data = publish.serialize(weights, self.version)
            digest = hashlib.sha256(data).hexdigest()
            if published.get(self.version) == digest:
                self.publisher.adopt(self.version, data, digest)
                continue
            # a non-deterministic kernel, an episode gone from the log, a version event trimmed away: the trainer goes
            # on from its own weights, and the next version is a full file (no worker holds these bytes)
            differing.append(self.version)
            self.publisher.forget()
            self.log.warning(
                "version re-derived differently from the published one; training goes on from the re-derived weights",
                version=self.version,
                published=(published.get(self.version) or "none kept")[:12],
                rederived=digest[:12],
            )
        self.counts.update(lines[-1].get("counts", {}))
        # a second crash would re-train these versions again, and the ones after them
        self.snapshots.trained(time.monotonic() - t0)
        rec = replay.summary(since, replayed, differing, republished) | {
            "missing_episodes": len(self.intake.missing),
            "seconds": round(time.monotonic() - t0, 3),
            "time": time.time(),
        }
        jsonl.append(self.ckpt_dir / ledger.REPLAYS, rec)
        self.log.info(
            "versions re-trained",
            snapshot=since,
            version=self.version,
            differing=len(differing),
            seconds=rec["seconds"],
        )

    def _tell(self, message: dict) -> None:
        """Rank 0: send the other ranks their next command (nothing when alone, nor on the other ranks)."""
        self.topology.tell(message)

    def _publish_state(self) -> dict:
        """The full weights a version publishes; under torchrun gathered to rank 0 (every rank calls this)."""
        return self.topology.publish_state(self.policy)

    def _republish_if_lost(self) -> None:
        """While idle, every 2 s: a Redis restart that lost its last second can lose the newest version
        event, and then nobody syncs it (the staleness gate stays at the old version and rollout waits for
        a version that never comes). Send the last event again when the stream is behind."""
        now = time.monotonic()
        if now < self._next_version_check or self.version == 0:
            return
        self._next_version_check = now + 2.0
        if self.publisher.republish_last(publish.latest_version(self.client, self.keys)):
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
    def _learn(self, groups: list[tuple[str, str, list[Episode]]]) -> tuple[Batch, dict]:
        """One optimizer step on ``groups`` (every rank gets the batch); a restore's re-training takes the same path."""
        batch = build_batch(
            [eps for _, _, eps in groups],
            self.pad_id,
            self.version,
            self.cfg.hard_max_staleness,
            self.policy.route_shape,
        )
        # every rank gets the batch's ids and tensors (nothing to share when alone)
        self.topology.share_batch(groups, batch)
        stats = self._train(batch)
        # benchmarks: a SIMULATED GPU's training time, not real work
        if self.cfg.simulated_train_us_per_token:
            time.sleep(batch.num_tokens * self.cfg.simulated_train_us_per_token / 1e6)
        self.step += 1
        return batch, stats

    def train_step(self, groups: list[tuple[str, str, list[Episode]]]) -> dict:
        t0 = time.monotonic()
        batch, stats = self._learn(groups)
        # what a restore trains again, in this order
        self.batches.append(commit_path.batch_of([(g, [ep.episode_id for ep in eps]) for _, g, eps in groups]))
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
        seconds = time.monotonic() - t0
        self.snapshots.trained(seconds)
        return self._metrics(batch, groups, stats, seconds)

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
    def commit(self, told: dict | None = None) -> None:
        """New version: ledger line, acknowledgements, hand-over to the publisher, maybe a snapshot, in that order
        (services/trainer/state/commit.py). Under torchrun every rank runs it (rank 0 sends ``commit``): the weights'
        gather and the snapshot are collectives; the ledger and the samples are rank 0's."""
        if told is None:
            # rank 0 decides (a snapshot falls due by time too, and ranks' clocks differ) and tells the others
            told = {"op": "commit", "version": self.version + 1, "snapshot": self.snapshots.due(self.version + 1)}
            self._tell(told)
        self.topology.land(self.snapshots)
        if not distributed.all_finite(self.model, self.shard):
            raise RuntimeError("non-finite model weights: refusing to commit or publish them")
        self.version = told["version"]
        fault = lambda point: crash_point("trainer", point)  # noqa: E731 (tests only: shared/runtime/faults.py)
        # the version's weights, copied now: training goes on while the publisher's thread writes them
        weights = publish.frozen(self._publish_state(), self.cfg.publish_dtype, into=self.publisher.spare())
        if self.shard.main:
            trained, skipped = self.intake.to_commit()
            line = commit_path.record(self.version, self.step, trained, skipped, self.batches, self.counts)
            fault("before_ledger")
            ledger.append_ledger(self.ckpt_dir, line)
            self.batches = []
            fault("after_ledger")
            self.intake.committed(trained + skipped)
            self.intake.acknowledge()
            fault("after_ack")
            self.publisher.submit(self.version, self.step, weights)
            # what no commit can need again leaves Redis
            self.samples_head.maybe_trim()
        if told["snapshot"]:
            self._snapshot()

    def _snapshot(self) -> None:
        meta = {"step": self.step, "version": self.version, "counts": dict(self.counts)}
        self.topology.snapshot(self.snapshots, self.model, self.opt, meta)

    def _snapshot_landed(self, record: dict) -> None:
        """From the snapshot's thread (rank 0's commit under torchrun): ``streamrl status`` shows the newest."""
        if self.shard.main:
            record_metrics(self.client, self.keys, "snapshot", record)

    def run(self, should_stop=lambda: False) -> None:
        if not self.shard.main:
            return self.follow()
        self.restore()
        # the next batch is read and folded while this one trains: two batches' entries at most
        self.intake.read_ahead(depth=2 * self.cfg.batch_groups)
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
            self.intake.close()
            # the last version is published and the last snapshot lands before a warm stop returns
            self.publisher.close()
            self.topology.land(self.snapshots, wait=True)
            self.snapshots.close()

    def follow(self) -> None:
        """A rank other than 0 under torchrun: restore from the newest snapshot, then do what rank 0 says (a restore's
        re-training comes as the same steps and gathers as training's)."""
        self._load_snapshot()
        while (message := distributed.broadcast(self.shard))["op"] != "stop":
            if message["op"] == "step":
                self._train(distributed.broadcast_batch(self.shard, message))
                self.step += 1
            elif message["op"] == "commit":
                self.commit(message)
            elif message["op"] == "gather":
                # a restore's re-trained version: hashed on rank 0
                self.version = message.get("version", self.version)
                self._publish_state()
            elif message["op"] == "snapshot":
                self._snapshot()
                if message.get("wait"):
                    self.topology.land(self.snapshots, wait=True)
            # "idle": rank 0 is waiting for samples
        self.topology.land(self.snapshots, wait=True)
        self.log.info("rank 0 stopped; this rank stops with it", step=self.step, version=self.version)
