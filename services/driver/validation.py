"""Validation rounds: a held-out split rolled out with the current version, never trained on.

Every ``val_every`` versions the driver enqueues one round on the ``prompts:val`` stream: each held-out prompt twice,
once greedy (temperature 0) and as a group of ``val_k`` episodes sampled with the run's settings. Rollout workers
serve that stream before the training one and publish its finished groups to ``samples:val``, which the trainer never
reads. When every group of a round is back, the round's rewards go to the metrics stream as a ``validation`` entry
(and to TensorBoard when enabled), with pass@k (share of prompts with at least one of its k sampled episodes at full
reward, >= 1.0) and mean@k (mean reward of the sampled episodes). Group ids name the round: ``val-v<version>-g<i>``
(greedy) and ``val-v<version>-s<i>`` (sampled)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import Keys
from shared.protocol.streams import metrics, samples, stream_head, val_groups
from shared.protocol.streams.prompts import PromptGroup, enqueue, forget
from shared.protocol.streams.val_groups import parse_group_id
from shared.runtime.prompt_format import prompt_key

# an episode passes (for pass@k) at this reward or above
PASS = 1.0


def split(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, held out): a row is held out when the hash of its prompt falls under ``fraction``, so a prompt that
    occurs several times is always on one side, and the split does not depend on row order."""
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0 or not rows:
        return list(rows), []
    h = {
        prompt_key(row["prompt"]): int.from_bytes(
            hashlib.sha256(prompt_key(row["prompt"]).encode()).digest()[:8], "big"
        )
        / 2**64
        for row in rows
    }
    if len(h) == 1:
        # one distinct prompt: nothing to hold out
        return list(rows), []
    # tiny datasets: hold out at least the lowest-hashed prompt and train on at least the highest-hashed one
    cut = min(max(fraction, min(h.values())), max(h.values()) - 1e-12)
    return (
        [r for r in rows if h[prompt_key(r["prompt"])] > cut],
        [r for r in rows if h[prompt_key(r["prompt"])] <= cut],
    )


def round_groups(version: int, rows: list[dict], size: int, k: int = 1) -> list[PromptGroup]:
    """One validation round: the first ``size`` distinct held-out prompts, each greedy and ``k`` times sampled."""
    seen, out = set(), []
    for row in rows:
        if prompt_key(row["prompt"]) in seen:
            continue
        seen.add(prompt_key(row["prompt"]))
        task = {k: v for k, v in row.items() if k != "prompt"}
        i = len(seen) - 1
        out.append(
            PromptGroup(
                val_groups.group_id(version, "greedy", i),
                1,
                prompt=row["prompt"],
                task=task,
                sampling={"temperature": 0.0},
            )
        )
        out.append(PromptGroup(val_groups.group_id(version, "sampled", i), k, prompt=row["prompt"], task=task))
        if len(seen) >= size:
            break
    return out


def summarize(
    version: int,
    rewards: dict[str, list[float]],
    token_versions: list[int],
    sampled_groups: list[list[float]] | None = None,
    k: int = 1,
) -> dict:
    """The metrics entry of one finished round; ``sampled_groups``: the rewards of each prompt's k samples."""
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    groups = sampled_groups or []
    return {
        "version": version,
        "time": time.time(),
        "reward_mean": mean(rewards.get("sampled", [])),
        f"pass@{k}": mean([float(any(r >= PASS for r in g)) for g in groups]),
        f"mean@{k}": mean([mean(g) for g in groups if g]),
        "reward_greedy": mean(rewards.get("greedy", [])),
        "n": sum(len(v) for v in rewards.values()),
        "token_version_min": min(token_versions, default=version),
        "token_version_max": max(token_versions, default=version),
    }


def asked_before(requested: set[int], version: int) -> bool:
    """Whether the round of ``version`` was requested already (by this driver or one before a restart): it is in
    ``requested`` (the set ``validation:requested``), or older than its newest round. The driver asks only for the
    newest version, which never goes back, so the set keeps only its newest round (older ones are removed as a new
    one is asked for) and still answers for every round before it."""
    return version in requested or version < max(requested, default=-1)


@dataclass
class Round:
    expected: int
    rewards: dict[str, list[float]] = field(default_factory=dict)
    token_versions: list[int] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    # per sampled group: its k rewards
    sampled: list[list[float]] = field(default_factory=list)


class Validator:
    """The driver's side: enqueue rounds, gather their samples, report each round once."""

    def __init__(
        self,
        client,
        keys: Keys,
        rows: list[dict],
        every: int,
        size: int,
        log=None,
        on_result=None,
        k: int = 1,
        archive=None,
        run_path=None,
    ):
        self.client, self.keys, self.rows, self.every, self.size, self.k = client, keys, rows, every, size, k
        self.log, self.on_result = log, on_result
        # ``archive``: the run's segments, where the archiver may have moved a round's episodes (a driver that
        # restarts after a long stop reads them there)
        self.episodes = EpisodeLog(client, keys, "validator", archive=archive)
        self.rounds: dict[int, Round] = {}
        # ``run_path``: where the driver moves samples:val's and the metrics' older entries (services/driver/heads.py)
        self.head = stream_head.path_of(run_path, stream_head.NAMES["samples:val"]) if run_path is not None else None
        self.cursor = "0-0"
        reported = (
            metrics.history(client, keys, run_path, ("validation",))["validation"]
            if run_path is not None
            else [r for _, r in metrics.read(client, keys, "validation")]
        )
        self.reported = {r["version"] for r in reported}
        self.requested = {int(v) for v in client.smembers(self._requested_key)}
        # rounds this driver enqueued whose enqueue markers are still there
        self.marked: set[int] = set()

    @property
    def _requested_key(self) -> str:
        return self.keys.val_requested

    def maybe_request(self, version: int) -> bool:
        """Enqueue the round of ``version`` when it is due and not requested before (also across driver restarts)."""
        self._forget_before(version)
        if not self.every or not self.rows or version % self.every or asked_before(self.requested, version):
            return False
        # the round's group ids are deterministic and enqueueing is idempotent: a retried SADD that reports the
        # round as requested (its first execution's reply lost) still enqueues it, at most once per group
        first = self.client.sadd(self._requested_key, version)
        groups = round_groups(version, self.rows, self.size, self.k)
        enqueued = any(enqueue(self.client, self.keys, groups, stream=self.keys.val_prompts))
        older = {v for v in self.requested if v < version}
        # the newest round stands for them (asked_before): the set keeps one round, not every one, so it does not grow
        # with the run
        if older:
            self.client.srem(self._requested_key, *older)
            self.requested -= older
        self.requested.add(version)
        if not enqueued and not first:
            return False
        self.marked.add(version)
        self.rounds[version] = Round(expected=len(groups))
        return True

    def _forget_before(self, version: int) -> None:
        """Drop the enqueue markers of the rounds before ``version``: the driver asks only for the newest version,
        which never goes back, so no driver (this one restarted) asks for their rounds again; their markers would
        otherwise pile up with the run."""
        stale = sorted(v for v in self.marked if v < version)
        if stale:
            pipe = self.client.pipeline(transaction=False)
            for v in stale:
                forget(pipe, self.keys, [g.group_id for g in round_groups(v, self.rows, self.size, self.k)])
            pipe.execute()
            self.marked -= set(stale)

    def poll(self) -> list[dict]:
        """Read newly finished validation groups; return the summaries of rounds that just completed."""
        done = []
        found, _, self.cursor = samples.read_after(self.client, self.keys.val_samples, self.cursor, head=self.head)
        for sample in found:
            group_id = sample.group_id
            parsed = parse_group_id(group_id)
            if parsed is None:
                continue
            version, kind = parsed
            if version in self.reported:
                # reported once, never again: its episodes need not be read (a restarted driver reads all)
                continue
            # requested by an earlier driver process: same groups
            if version not in self.rounds:
                self.rounds[version] = Round(expected=len(round_groups(version, self.rows, self.size, self.k)))
            rnd = self.rounds[version]
            if group_id in rnd.seen:
                continue
            rnd.seen.add(group_id)
            group_rewards = []
            for eid in sample.episodes:
                try:
                    ep = fold(self.episodes.read(eid))
                except EventError:
                    ep = None
                reward = ep.reward if ep is not None and ep.status == "finished" else 0.0
                rnd.rewards.setdefault(kind, []).append(float(reward or 0.0))
                group_rewards.append(float(reward or 0.0))
                rnd.token_versions += [v for v in (ep.versions if ep else []) if v >= 0]
            if kind == "sampled":
                rnd.sampled.append(group_rewards)
            if len(rnd.seen) >= rnd.expected and version not in self.reported:
                done.append(self._report(version, rnd))
        return done

    def _report(self, version: int, rnd: Round) -> dict:
        summary = summarize(version, rnd.rewards, rnd.token_versions, rnd.sampled, self.k)
        metrics.record(self.client, self.keys, "validation", summary)
        self.reported.add(version)
        if self.on_result:
            self.on_result(summary)
        if self.log:
            self.log.info(
                "validation",
                version=version,
                reward_sampled=round(summary["reward_mean"], 3),
                reward_greedy=round(summary["reward_greedy"], 3),
            )
        return summary
