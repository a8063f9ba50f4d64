"""One flat config object for every service (nanoGPT style): its keys, types, defaults and one-line descriptions.

Where values come from (defaults < TOML file < environment < flags) and how they are read and validated:
``config_sources.py``; the rules on values: ``config_checks.py``; ``--help`` and ``streamrl config`` read the
descriptions below (``configdoc.py``). This module imports none of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


@dataclass
class Config:
    # where
    run: str = "demo"
    """namespaces every Redis key: streamrl:{<run>}:... (episode streams: streamrl:<run>:ep:{<id>})"""
    redis_url: str = "redis://127.0.0.1:6390/0"
    """the run's Redis (`streamrl redis` serves its port); password: redis://:secret@host:port/0; a Redis Cluster:
    redis+cluster://[:secret@]host:port (any one node)"""
    rq_redis_url: str = ""
    """the Redis of the rq job queues (tools, rewards, agent episodes); empty: redis_url. Must be a single server (rq
    does not run on a cluster): required when redis_url is a cluster"""
    run_dir: str = "runs"
    """each run's state is in <run_dir>/<run>: Redis data, trainer checkpoint, metrics, plots"""
    redis_maxmemory: str = "4gb"
    """the embedded Redis's memory cap (Redis units: 512mb, 4gb; 0: none), with noeviction: a full Redis refuses
    writes and every service stops saying so in one line"""
    redis_wait: float = 30.0
    """seconds a process retries a Redis that does not answer (at start, after a restart) before it stops with one
    line (at most 60: control-write markers live 120 s)"""
    run_id: str = ""
    """the run's id (run.json, Redis meta): set by each process when it binds to the run, never by hand; keys the
    default weights folders, so two runs of one name never share one"""
    log_level: str = "info"
    """debug | info | warning | error (`streamrl run` runs the services at warning when info)"""
    # episode log
    flush_tokens: int = 16
    """flush an episode's buffered tokens once this many are pending"""
    flush_ms: float = 50.0
    """... or once the oldest pending token is this old"""
    log_retention_versions: int = 20
    """the archiver moves episodes of groups trained this many versions before the newest commit out of Redis into
    Parquet segments under <run_dir>/<run>/episodes (readers see both tiers), so Redis's memory stays flat however
    long the run; 0: off, every episode stays in Redis"""
    archive_every_versions: int = 50
    """the archiver moves episodes each time this many versions have been published since its last move (Redis then
    holds at most log_retention_versions + this many versions of episodes, at any rate); 0: by archive_every_s
    only"""
    archive_every_s: float = 30.0
    """... and at the latest this many seconds after its last move (a slow run still moves)"""
    archiver_nice: int = 19
    """the archiver's CPU priority (os.nice, 0-19; 19 the lowest): it moves episodes on CPU the pipeline leaves idle"""
    stream_keep_s: float = 10.0
    """entries of prompts, samples, their :val streams, metrics and versions that no live reader needs any more stay
    in Redis this many seconds, then move to <run_dir>/<run>/streams/<name>.jsonl (whole-run readers read both)"""
    # model
    model_dir: str = "models/tiny"
    """HF causal LM: a folder (config, safetensors, tokenizer) or a hub id (local cache when offline); only
    models/tiny is created when missing"""
    tokenizer: str = ""
    """folder for decoding text in `streamrl replay`; empty means model_dir"""
    model_moe: str = ""
    """the default tiny model (model_dir models/tiny) as a mixture of experts: qwen3 | mixtral | olmoe (8 experts,
    top-2, about the dense model's active parameters); empty: the dense Llama. Another model_dir ignores it"""
    stop: str = ""
    """extra stop tokens beside EOS and generation_config's EOS ids: comma-separated token ids or one-token strings"""
    # rollout
    engine: str = "torch"
    """torch | vllm"""
    vllm_args: str = ""
    """engine=vllm: JSON object of extra vllm.EngineArgs, e.g. {"gpu_memory_utilization": 0.8}"""
    device: str = "cpu"
    """cpu | cuda | cuda:N: every service's device unless rollout_device / trainer_device says otherwise"""
    rollout_device: str = ""
    """the rollout engine's device; empty: device"""
    max_batch_size: int = 64
    """sequences decoded together by the engine"""
    max_groups_in_flight: int = 8
    """prompt groups one rollout worker holds at once"""
    rollout_workers: int = 1
    """rollout worker processes `streamrl run` starts (honcho start: `-c rollout=N`)"""
    group_size: int = 8
    """episodes per prompt group (GRPO n); docs/training.md says why the defaults"""
    max_tokens: int = 32
    """generated-token budget per episode"""
    temperature: float = 1.0
    """sampling temperature (0: greedy)"""
    top_p: float = 1.0
    """nucleus sampling: keep the smallest set of tokens with this much probability"""
    top_k: int = 0
    """sample from the k most likely tokens only; 0: all"""
    seed: int = 0
    """base sampling seed; each episode derives its own"""
    tools: str = ""
    """tools the model may call, comma-separated: built-in names (calc) or module:function specs; empty: single-turn"""
    tool_timeout: float = 10.0
    """seconds one tool call may run (rq job timeout)"""
    max_tool_calls: int = 4
    """per episode; one more ends it with reason 'tool_limit'"""
    reward_fn: str = "services.rollout.jobs.rewards:arithmetic"
    """module:function(response, task[, prompt=]) -> float | (float, dict), may be async; runs as an rq job unless
    marked @rewards.inline"""
    reward_timeout: float = 60.0
    """seconds one reward job may run; past it the episode fails (where: reward)"""
    heartbeat_ttl: float = 5.0
    """seconds after its last heartbeat a worker counts as dead"""
    max_calls_in_flight: int = 64
    """gateway LLM calls one rollout worker serves at once"""
    # rollout: long-tail repack (docs/scale.md, "Long-tail repack")
    rollout_role: str = "normal"
    """normal | longtail: a long-tail worker takes groups repacked from other workers first (advertised in its
    heartbeat)"""
    longtail_workers: int = 0
    """of the rollout_workers `streamrl run` starts, how many run as rollout_role=longtail (the last ones)"""
    repack_below: float = 0.0
    """a normal worker hands its long-tail groups to a long-tail worker once its generating episodes are <= this
    fraction of its capacity (min(max_batch_size, max_groups_in_flight x group_size)); 0: never (off)"""
    repack_min_tokens: int = 32
    """... only groups with an episode that has generated at least this many tokens"""
    longtail_claim_share: float = 0.5
    """share of a long-tail worker's max_groups_in_flight it fills with new groups; the rest stays free for repacked
    ones"""
    # agents and the gateway
    agent: str = ""
    """module:function(client, task) -> reward | {"reward", "details"}: a user agent run per episode"""
    agent_workers: int = 4
    """agents worker processes `streamrl run` starts"""
    agent_concurrency: int = 1
    """agent episodes each agents worker runs at once (threads: agents mostly wait on the LLM and their tools)"""
    agent_timeout: float = 600.0
    """seconds one agent episode may run (rq job timeout)"""
    fail_fast_groups: int = 32
    """agent runs: when the first this many groups' episodes all failed with the same error and nothing has trained,
    the driver stops the run with that error (exit 1) instead of failing episodes until max_minutes; 0: never"""
    gateway_host: str = "127.0.0.1"
    """the gateway listens here (loopback by default)"""
    gateway_port: int = 8321
    """... on this port"""
    gateway_url: str = ""
    """how agents reach a gateway; empty: http://gateway_host:gateway_port"""
    gateway_api_key: str = ""
    """the gateway's bearer key; empty: the run's secrets file's (streamrl run makes one); agents get per-episode
    keys derived from it (docs/security.md)"""
    gateway_timeout: float = 60.0
    """seconds a non-streaming call is held before a 503 asking the client to retry"""
    # trainer
    batch_groups: int = 8
    """prompt groups per optimizer step"""
    steps_per_version: int = 1
    """optimizer steps between weight publishes"""
    snapshot_every_versions: int = 25
    """the trainer snapshots model, optimizer and RNG every this many versions, in the background; a restart loads the
    newest snapshot and re-trains the versions after it from the episode log (docs/faults.md); 0: by
    snapshot_every_s only"""
    snapshot_every_s: float = 300.0
    """... or when this many seconds have passed since the last snapshot; 0: by versions only"""
    snapshot_replay_s: float = 0.15
    """... or once the train steps since the last snapshot took this many seconds, so that a restart re-trains about
    that much (plus reading their episodes); never more often than 20x the last snapshot's own cost (its copy and
    its write's CPU time); 0: off"""
    deterministic: bool = True
    """torch deterministic algorithms in the trainer, so a re-trained version hashes as it was published (free on the
    CPU; what it costs on a GPU: docs/faults.md)"""
    lr: float = 3e-4
    """AdamW learning rate"""
    loss: str = "decoupled"
    """decoupled (AReaL's off-policy PPO) | ppo (plain PPO-clip vs behaviour)"""
    agg: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum"""
    clip_low: float = 0.2
    """PPO clip: the ratio may fall to 1 - clip_low"""
    clip_high: float = 0.2
    """PPO clip: the ratio may rise to 1 + clip_high"""
    clip_ratio_c: float = 3.0
    """dual-clip: objective >= c·A for A < 0 (verl's clip_ratio_c); 0 disables"""
    is_cap: float = 5.0
    """cap on the proximal/behaviour importance weight (decoupled); 0 disables"""
    is_mode: str = "mask"
    """mask: tokens whose weight is over is_cap leave the objective (AReaL) | truncate: weight = is_cap"""
    is_level: str = "token"
    """the weight's level: token (AReaL) | sequence (exp of the summed log-ratio) | geometric (its mean)"""
    icepop_beta: float = 0.0
    """IcePop: tokens whose ratio is outside [1/beta, beta] leave the objective; 0: off"""
    m2po_tau: float = 0.0
    """M2PO: drop the largest log-ratios until their mean square is <= tau (e.g. 0.04); 0: off"""
    ppo_minibatches: int = 2
    """optimizer steps per batch, one per minibatch, against one proximal forward"""
    micro_batch_tokens: int = 4096
    """padded tokens per forward/backward (gradients accumulate); 0: no limit"""
    max_grad_norm: float = 1.0
    """clip the gradient to this global norm"""
    hard_max_staleness: int = 0
    """policy tokens more versions behind than this are masked out (counted); 0: none"""
    filter_constant_groups: bool = False
    """drop groups whose rewards are all equal (dynamic sampling; counted)"""
    trainer_device: str = ""
    """the trainer's device; empty: device"""
    dtype: str = "float32"
    """trainer compute: float32, or bfloat16 (bf16 autocast; master weights and optimizer stay fp32)"""
    grad_checkpointing: bool = False
    """recompute activations in backward: less memory, ~30% more compute"""
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank (PEFT) instead of every weight; versions publish merged weights"""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (scale = lora_alpha / lora_rank)"""
    lora_targets: str = "all-linear"
    """modules that get adapters: all-linear, or comma-separated names (q_proj,v_proj)"""
    kl_coef: float = 0.0
    """> 0: add kl_coef x KL(policy || frozen reference = the initial model) to the loss"""
    routing_replay: bool = True
    """a mixture-of-experts policy: the rollout engine logs each sampled token's experts and the trainer's forward
    routes it through them (R3, docs/models.md); false: the trainer's router chooses again. No effect on a dense
    model"""
    kl_estimator: str = "k3"
    """k1 (log ratio) | k3 (Schulman's unbiased, always >= 0)"""
    weights_dir: str = ""
    """published versions; empty: /dev/shm/streamrl-<uid>/<run>-<run id> when /dev/shm exists (private to you, one
    per run), else <run_dir>/<run>/weights"""
    # staleness and sync
    max_staleness: int = 1
    """versions a trained token may lag the trainer; 0 with mode=sync is synchronous RL"""
    mode: str = "async"
    """async | sync (rollout waits for the trainer, trainer for a full batch)"""
    sync_timeout: float = 30.0
    """seconds the syncer waits for a worker's ack before going on without it"""
    # staleness and sync: weights over the wire (docs/operations.md section 8)
    weights_fetch: str = "auto"
    """how a rollout worker gets a version's file: auto (the published path when it is readable here, else a download
    from the version's url) | always (download) | never (the published path only)"""
    rollout_weights_dir: str = ""
    """a rollout worker's own folder for downloaded versions (never weights_dir); empty:
    /dev/shm/streamrl-<uid>/<run>-<run id>-fetched when /dev/shm exists, else <run_dir>/<run>/fetched"""
    rollout_weights_keep: int = 2
    """downloaded versions a rollout worker keeps; older ones are deleted"""
    weights_host: str = "127.0.0.1"
    """the trainer's weight server listens here (loopback by default; 0.0.0.0 for workers on other hosts)"""
    weights_port: int = 0
    """... on this port: HTTP GET (with ranges) and HEAD of the files in weights_dir; 0: no server (workers read
    weights_dir)"""
    weights_url: str = ""
    """the weight server's address as rollout workers reach it, put in each version event; empty:
    http://weights_host:weights_port"""
    weights_token: str = ""
    """the weight server's bearer token, sent by rollout workers to announced origins only; empty: the run's secrets
    file's (streamrl run makes one)"""
    fetch_timeout: float = 120.0
    """seconds the syncer waits for every worker to hold a version's file (downloaded, verified) before it pauses
    them; a slower one then gets it inside its own pause"""
    sync_mode: str = "global"
    """how a version reaches the rollout workers (async mode): global (fetch, then pause every worker, load, resume)
    | rolling (fetch, then pause/load/resume one wave of at most max_loading workers at a time, so generation
    never stops; the gate opens once every worker runs the version) | pull (the syncer only opens the gate; each
    worker downloads an announced version itself, from its relay parent or the trainer, while it generates, and
    loads it at a cheap point of its own under a lease of at most max_loading workers)"""
    max_loading: int = 1
    """sync_mode rolling and pull: at most this many rollout workers paused (loading) at once"""
    pull_load_below: float = 0.5
    """sync_mode pull: a worker holding a downloaded newer version loads it once fewer than this fraction of its
    max_groups_in_flight slots still generate (at once when gated or idle)"""
    pull_max_wait_s: float = 10.0
    """sync_mode pull: ... and at the latest this many seconds after the version was published, however busy it is"""
    load_lease_s: float = 60.0
    """sync_mode pull: a load lease expires this many seconds after it was taken (a worker killed while loading
    blocks the others at most this long); longer than a load takes"""
    relay_port: int = 0
    """> 0: a rollout worker serves its downloaded, verified versions on this port (the weight server's code,
    weights_token) and other workers fetch from it; -1: a free port; 0: no relay"""
    relay_host: str = "127.0.0.1"
    """... on this address, as other workers reach it (loopback by default; a private interface for workers on other
    hosts)"""
    relay_fanout: int = 2
    """the fetch tree: the trainer's server feeds this many relaying workers, each of them this many more, and so on"""
    publish_dtype: str = ""
    """the dtype of a published version's file (the serving dtype): bfloat16 | float16 | float32; empty: as trained
    (float32 master weights)"""
    delta_max_chain: int = 10
    """the trainer publishes each version as its delta against the version before (docs/operations.md section
    8); a rollout worker at most this many versions behind makes the new version from its own copy and the deltas,
    one further behind downloads the file (the snapshot); 0: no deltas"""
    delta_max_fraction: float = 0.25
    """... but no delta when it would be larger than this fraction of the file (the file is the cheaper way)"""
    publish_full_every: int = 50
    """the trainer writes a version's full file every this many versions (and the first after a start); the versions
    between are deltas, and their files are made from the chain by whoever needs one; 0: only when a delta cannot be"""
    # the run (driver)
    dataset: str = "arithmetic"
    """built-in task, a .jsonl / .json / .parquet / .csv file, or a hub dataset name (local cache when offline)"""
    dataset_split: str = "train"
    """split of a hub dataset to train on"""
    prompt_key: str = "prompt"
    """column holding the prompt: text or chat messages; with the default 'prompt', a 'messages' column is used when
    there is none (a key you name must exist)"""
    answer_key: str = "answer"
    """column holding the ground truth (handed to the reward as task['answer']); optional with chat rows"""
    shuffle: bool = True
    """shuffle the training rows with the run's seed, again every epoch"""
    epochs: int = 0
    """passes over the training rows, then the run ends once they are trained; 0: cycle until max_versions /
    max_minutes"""
    eval_dataset: str = ""
    """validation prompts from this dataset (same forms as dataset); empty: the held-out split of dataset"""
    eval_split: str = "test"
    """split of a hub eval_dataset"""
    val_k: int = 1
    """sampled episodes per held-out prompt in a validation round: pass@k and mean@k"""
    max_versions: int = 1000
    """the driver ends the run at this version; 0: no limit"""
    max_minutes: float = 10.0
    """... or after this long; 0: no limit"""
    val_every: int = 25
    """a validation round every this many versions (held-out prompts, greedy + sampled); 0: none. Each round is
    rolled out beside the training batches: on a rollout with no spare capacity it delays the next one"""
    val_size: int = 16
    """held-out prompts per validation round"""
    val_fraction: float = 0.1
    """share of the task's distinct prompts held out for validation, never trained on"""
    tensorboard: bool = False
    """also write metrics as TensorBoard event files to <run_dir>/<run>/tensorboard"""
    wandb: str = ""
    """online | offline: also log metrics to Weights & Biases (one wandb run per process, grouped by run); empty: off"""
    wandb_project: str = "streamrl"
    """the wandb project"""
    export_every: int = 0
    """also save a Hugging Face folder every this many versions (always at the end): <run_dir>/<run>/export/v<N>; 0:
    end only"""
    # the browser view (streamrl ui)
    ui_host: str = "127.0.0.1"
    """`streamrl ui` listens here (loopback by default; it shows every run under run_dir)"""
    ui_port: int = 8322
    """... on this port (`streamrl ui --port P`); the gateway_api_key, when set, is its key too (docs/security.md)"""
    # simulation (drills and benchmarks only: a GPU's cost stood in for on a CPU box; 0 in every real run)
    simulated_train_us_per_token: float = 0.0
    """benchmarks only: the trainer also sleeps this long per trained token, a SIMULATED stand-in for GPU training
    time on a CPU box (bench/learning/async_vs_sync.py --simulate-gpu)"""
    step_delay_ms: float = 0.0
    """drills and benchmarks: wrap the engine in a simulated slow one (engine/slow.py) sleeping this long per step"""
    simulated_load_ms: float = 0.0
    """benchmarks only: that simulated engine also sleeps this long per weight load, a SIMULATED stand-in for loading
    a large model's weights on a GPU (bench/learning/trajectory_async.py --simulated-load-ms)"""

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) / self.run

    def device_of(self, service: str) -> str:
        """The device of ``service`` ("rollout" or "trainer"): its own key, else ``device``."""
        return getattr(self, f"{service}_device") or self.device

    @property
    def agent_gateway_url(self) -> str:
        return self.gateway_url.rstrip("/") or f"http://{self.gateway_host}:{self.gateway_port}"

    @property
    def _run_key(self) -> str:
        return f"{self.run}-{self.run_id}" if self.run_id else self.run

    @property
    def weights_path(self) -> Path:
        """weights_dir, else /dev/shm/streamrl-<uid>/<run>-<run id> (per user, per run: shared/runtime/folders.py)."""
        from shared.runtime.folders import shared_memory_root

        if self.weights_dir:
            return Path(self.weights_dir)
        root = shared_memory_root()
        return root / self._run_key if root else self.run_path / "weights"

    @property
    def rollout_weights_path(self) -> Path:
        """A rollout worker's own folder for the versions it downloads."""
        from shared.runtime.folders import shared_memory_root

        if self.rollout_weights_dir:
            return Path(self.rollout_weights_dir)
        root = shared_memory_root()
        return root / f"{self._run_key}-fetched" if root else self.run_path / "fetched"

    @property
    def weights_base_url(self) -> str:
        """Where rollout workers reach the trainer's weight server ('' when it serves none)."""
        if self.weights_url:
            return self.weights_url.rstrip("/")
        return f"http://{self.weights_host}:{self.weights_port}" if self.weights_port else ""


FIELDS = {f.name: f for f in fields(Config)}


def rq_url(cfg: Config) -> str:
    """The URL of the rq job queues' Redis: ``rq_redis_url``, else ``redis_url``."""
    return cfg.rq_redis_url or cfg.redis_url
