"""The vLLM engine: continuous-batching generation for Qwen2.5-VL and Qwen3-VL video, image and text prompts.

Frames come from physreason's `vision` layer (already sampled and resized), so vLLM's processor is
told not to sample or resize again; prompts are rendered with the model's chat template exactly as
the transformers engine renders them, so both engines see the same tokens.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from transformers import GenerationConfig

from physreason import vllm_compat
from physreason.config import EngineConfig, ModelConfig, SamplingConfig
from physreason.engines.base import Completion, Engine, GenerationRequest, GenerationResult, sampling_seed
from physreason.errors import PhysReasonError
from physreason.models import loading
from physreason.models.family import model_family, vision_special_token_ids
from physreason.models.inputs import IMAGE_PAD, VIDEO_PAD, ProcessorParams, load_processor_params
from physreason.models.qwen3_vl import frame_group_seconds
from physreason.models.source import check_model_weights
from physreason.vision import VideoFrames

log = logging.getLogger(__name__)


def _visual_token_count(frames: int, height: int, width: int, params: ProcessorParams) -> int:
    """Tokens one image/video placeholder expands to: (T / temporal patch) x (H / patch) x (W / patch) / merge^2."""
    grid_t = math.ceil(frames / params.temporal_patch_size)
    return grid_t * (height // params.patch_size) * (width // params.patch_size) // params.merge_size**2


def _video_text_token_count(video: VideoFrames, params: ProcessorParams, tokenizer: Any) -> int:
    """Qwen3-VL: text tokens a video adds besides its pads, `<t seconds>` plus span start/end per temporal patch."""
    if not params.video_timestamps_as_text:
        return 0
    seconds = frame_group_seconds(video.indices, video.source_fps, params.temporal_patch_size)
    stamps = tokenizer([f"<{s:.1f} seconds>" for s in seconds], add_special_tokens=False).input_ids
    return sum(len(ids) + 2 for ids in stamps)


def _check_fp8_push(weights: list[tuple[str, torch.Tensor]]) -> None:
    """Raise unless every FP8 weight of the push arrives as float8_e4m3fn with its scale (a bf16 one would be cast blindly)."""
    from physreason.models.fp8 import FP8_DTYPE, SCALE_SUFFIX, is_fp8_weight

    names = {name for name, _ in weights}
    wrong = [
        name
        for name, tensor in weights
        if is_fp8_weight(name) and (tensor.dtype != FP8_DTYPE or name + SCALE_SUFFIX not in names)
    ]
    if wrong:
        raise PhysReasonError(
            f"the FP8 rollout engine got {len(wrong)} language-model weight(s) without FP8 quantization, e.g. "
            f"{wrong[:3]}: push through train.weight_sync.PolicySync with quantization 'fp8'"
        )


class VLLMEngine(Engine):
    """Generation with `vllm.LLM`; all requests of a call are scheduled together (continuous batching)."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        lora_rank: int | None = None,
        quantization: str | None = None,
        **llm_overrides: Any,
    ) -> None:
        """lora_rank: give the engine a runtime LoRA slot of at least this rank (GRPO with [train.lora] pushes
        adapters there); `engine.lora` serves that adapter from the start (its rank counts too).
        quantization "fp8": the language model's linear layers hold block-FP8 weights (models/fp8.py) that start
        random; generate refuses to run until `update_weights` brought the policy's, quantized by the sender."""
        # The engine core runs in this process, so `update_weights` hands tensors to the model
        # without serialising them to another process (the RL weight-sync path). Export
        # VLLM_ENABLE_V1_MULTIPROCESSING=1 to get vLLM's separate engine-core process back.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if quantization == "fp8":
            # vLLM warms its DeepGEMM FP8 kernels for ~1,100 batch sizes at start: over 165 s on an H100 even for a
            # tiny model (physreason gpu-check, 2026-11-26). A rollout engine compiles the few it meets instead.
            os.environ.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
            # FlashInfer's sm90 block-scale FP8 GEMM is built with nvcc when CUDA graphs are captured: still building
            # after 160 s on an H200 (same check). DeepGEMM's kernels serve the same block-FP8 weights.
            os.environ.setdefault("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "0")
        from vllm import LLM

        warning = vllm_compat.check_supported()
        if warning:
            log.warning(warning)
        self.model_config = model
        self.engine_config = engine
        source = model.model_name_or_path
        hf_config = loading.load_model_config(model)
        # fp8 rollouts start from dummy weights and wait for the first push; so does load_format="dummy" (benchmarks)
        if quantization in (None, "none") and llm_overrides.get("load_format") != "dummy":
            check_model_weights(source)
        if not getattr(hf_config, "architectures", None):
            # vLLM resolves the model class from this list; without it vLLM 0.26 starts the checkpoint as a pooling
            # model, whose every generate request is refused (seen on an H200 on 2026-11-28)
            raise PhysReasonError(
                f"{source}: config.json names no 'architectures', so vLLM cannot tell which model class to run. Add "
                f"the class transformers saves, e.g. \"architectures\": [\"{model_family(hf_config).architectures[0]}\"]"
            )
        self.hf_config = hf_config
        self.is_vl = model_family(hf_config).is_vision_language
        self._weight_names: frozenset[str] | None = None
        self._linear_names: frozenset[str] = frozenset()
        self.quantization = None if quantization in (None, "none") else quantization
        self._weights_loaded = self.quantization is None
        # FP8: None until the first push found out whether pushes may copy into the live parameters (loads_in_place)
        self._loads_in_place: bool | None = None
        self.in_place_refusal: str | None = None  # why FP8 pushes may not copy in place (after the first push)
        self.max_model_len = engine.max_model_len or model.model_max_length
        kwargs = vllm_compat.llm_kwargs(
            model=source,
            revision=model.revision,
            dtype=model.dtype,
            max_model_len=self.max_model_len,
            tensor_parallel_size=engine.tensor_parallel_size,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            enforce_eager=engine.enforce_eager,
            trust_remote_code=model.trust_remote_code,
            logprobs_mode="raw_logprobs",
            seed=0,
            runner="generate",  # never a pooling model: physreason generates
        )
        if self.is_vl:
            kwargs["limit_mm_per_prompt"] = dict(engine.limit_mm_per_prompt)
        if self.quantization is not None:
            kwargs.update(self._quantized_kwargs())
        kwargs.update(vllm_compat.kv_cache_kwargs(engine.kv_cache_dtype))
        kwargs.update(vllm_compat.kv_cache_memory_kwargs(engine.kv_cache_memory_bytes))
        if engine.cuda_graph_sizes == "batch" and not engine.enforce_eager:
            sizes = vllm_compat.cudagraph_sizes([engine.batch_size])
            kwargs.update(vllm_compat.llm_kwargs(compilation_config={"cudagraph_capture_sizes": sizes}))
        ranks = [lora_rank] if lora_rank is not None else []
        if engine.lora is not None:
            from physreason.models.lora import check_adapter_base, read_adapter_config

            check_adapter_base(engine.lora, hf_config, model.model_name_or_path)
            ranks.append(int(read_adapter_config(engine.lora)["r"]))
        if ranks:
            kwargs.update(vllm_compat.lora_engine_kwargs(max(ranks)))
        self._adapter_slot = bool(ranks)
        self._adapter: Any = None  # the LoRARequest every generate call uses, or None
        self._adapter_versions = 0
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and engine.tensor_parallel_size == 1:
            # Under torchrun (colocated GRPO on several GPUs) every rank builds its own engine. vLLM's default
            # in-process executor would put each rank's engine on cuda:0; the external launcher takes the rank's
            # LOCAL_RANK GPU and joins torchrun's group. Call `vllm_compat.release_distributed` before
            # destroying that group.
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(llm_overrides)
        self.llm = LLM(**kwargs)
        runner = getattr(getattr(self.llm.llm_engine, "model_config", None), "runner_type", "generate")
        if runner != "generate":
            raise PhysReasonError(
                f"vLLM started {source} as a {runner!r} model, not a generative one: check config.json's "
                f"'architectures' ({hf_config.architectures})"
            )
        if self.quantization is not None:
            self._check_fp8_layers()
        self.tokenizer = self.llm.get_tokenizer()
        self.processor_params = load_processor_params(source, model.revision) if self.is_vl else None
        self.stop_token_ids = sorted(self._stop_token_ids(source, model.revision))
        if engine.lora is not None:
            self.load_adapter(engine.lora)

    def _quantized_kwargs(self) -> dict[str, Any]:
        """vLLM arguments of an FP8 rollout engine: a block-FP8 checkpoint config, random weights until the first push."""
        from physreason.models.fp8 import fp8_block_misfits, unquantized_linear_names, vllm_fp8_quantization_config

        if self.quantization != "fp8":
            raise PhysReasonError(f"rollout quantization {self.quantization!r} is not supported: use 'fp8' or 'none'")
        text = self.hf_config.get_text_config()
        if getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0):
            raise PhysReasonError(
                f"rollout.quantization = 'fp8' covers dense models; {self.model_config.model_name_or_path} is a "
                "mixture of experts: set rollout.quantization = 'none'"
            )
        misfits = fp8_block_misfits(text, self.engine_config.tensor_parallel_size)
        if misfits:
            raise PhysReasonError(
                f"rollout.quantization = 'fp8' stores 128 x 128 blocks in vLLM's fused q/k/v and gate/up layers, but "
                f"{self.model_config.model_name_or_path}: {'; '.join(misfits)}. Set rollout.quantization = 'none'"
            )
        self.weight_names()  # fills the linear layers' names
        config = vllm_fp8_quantization_config(unquantized_linear_names(self._linear_names))
        return vllm_compat.fp8_rollout_kwargs(config)

    def _check_fp8_layers(self) -> None:
        """Raise unless vLLM quantized exactly the language model's linear layers (what the sender quantizes)."""
        from physreason.models.fp8 import expected_fp8_layers

        names = vllm_compat.fp8_module_names(self.llm)
        expected = expected_fp8_layers(self.hf_config.get_text_config().num_hidden_layers)
        stray = [name for name in names if "visual" in name or "lm_head" in name]
        if len(names) != expected or stray:
            raise PhysReasonError(
                f"the FP8 rollout engine holds {len(names)} FP8 linear layers (expected {expected}, those of the "
                f"language model's blocks; outside them: {stray[:3]}): this vLLM release maps the ignored layers "
                "differently; set rollout.quantization = 'none'"
            )

    def _stop_token_ids(self, source: str, revision: str | None) -> set[int]:
        """The generation config's eos ids plus the tokenizer's, as the transformers engine stops on."""
        try:
            eos = GenerationConfig.from_pretrained(source, revision=revision).eos_token_id
        except OSError:
            eos = None
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _render(self, request: GenerationRequest) -> str:
        """The request's chat prompt as text, after checking its vision placeholders match its images and videos."""
        if (request.images or request.videos) and not self.is_vl:
            raise PhysReasonError(
                f"request {request.request_id}: model {self.model_config.model_name_or_path} is text-only "
                "and cannot take images or videos"
            )
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        for pad, items, kind in ((IMAGE_PAD, request.images, "image"), (VIDEO_PAD, request.videos, "video")):
            if text.count(pad) != len(items):
                raise PhysReasonError(
                    f"request {request.request_id}: the prompt has {text.count(pad)} {kind} placeholder(s) but "
                    f"{len(items)} {kind}(s) were given: pass one {kind} per {{'type': '{kind}'}} entry in the message content"
                )
        return text

    def _prompt(self, request: GenerationRequest, token_ids: list[int]) -> tuple[dict[str, Any], int]:
        """vLLM's token prompt for one request and its length in tokens after vision placeholders expand.

        vLLM gets our token ids (one `<|image_pad|>`/`<|video_pad|>` per item, which its processor expands),
        so the text is tokenized once, here, not again inside vLLM.
        """
        params = self.processor_params
        visual = [_visual_token_count(1, *image.shape[:2], params) for image in request.images]
        visual += [_visual_token_count(*video.frames.shape[:3], params) for video in request.videos]
        # Each placeholder is one token of the rendered text and becomes `count` tokens (plus, for Qwen3-VL,
        # each video's timestamp text and per-patch span markers).
        stamps = sum(_video_text_token_count(video, params, self.tokenizer) for video in request.videos)
        length = len(token_ids) + sum(visual) - len(visual) + stamps
        if length >= self.max_model_len:
            fix = "lower --fps or --total-pixels/--max-pixels" if visual else "shorten the question"
            raise PhysReasonError(
                f"request {request.request_id}: the prompt has {length} tokens ({sum(visual)} of them visual) but the "
                f"context is {self.max_model_len}: {fix}, or raise model.model_max_length / engine.max_model_len"
            )
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        media: dict[str, list] = {}
        if request.images:
            media["image"] = list(request.images)
        if request.videos:
            media["video"] = [
                vllm_compat.video_item(video, source_timing=params.video_timestamps_as_text) for video in request.videos
            ]
        if media:
            prompt["multi_modal_data"] = media
            # Frames and images are already sampled and resized to multiples of the patch factor by `vision`.
            prompt["mm_processor_kwargs"] = {"do_resize": False, "do_sample_frames": False}
        return prompt, length

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, *, logprobs: bool = True
    ) -> list[GenerationResult]:
        """Return one result per request in order; a request vLLM cannot take gets an error, not an exception."""
        self._check_open()
        if not self._weights_loaded:
            raise PhysReasonError(
                "this FP8 rollout engine starts with random weights: push the policy's weights (update_weights) "
                "before generating"
            )
        results = [GenerationResult(request_id=r.request_id) for r in requests]
        texts: list[tuple[int, str]] = []
        for i, request in enumerate(requests):
            try:
                texts.append((i, self._render(request)))
            except PhysReasonError as exc:
                results[i].error = str(exc)
        # One batched call: the fast tokenizer encodes a batch on all cores.
        encoded = self.tokenizer([text for _, text in texts], add_special_tokens=False).input_ids if texts else []
        prompts, params, indices = [], [], []
        # one SamplingParams per distinct (budget, request seed), not one per request; a request with a seed of its
        # own (GenerationRequest.seed, engines.base.sampling_seed) gets vLLM's per-request seed, as the hf engine
        # draws it from a generator of its own
        by_key: dict[tuple[int, int | None], Any] = {}
        for (i, _), token_ids in zip(texts, encoded, strict=True):
            try:
                prompt, length = self._prompt(requests[i], token_ids)
            except PhysReasonError as exc:
                results[i].error = str(exc)
                continue
            key = (min(sampling.max_tokens, self.max_model_len - length), sampling_seed(sampling, requests[i]))
            if key not in by_key:
                suppressed = vision_special_token_ids(self.hf_config) if sampling.suppress_vision_tokens else ()
                by_key[key] = vllm_compat.sampling_params(
                    sampling, key[0], self.stop_token_ids, logprobs, suppressed, seed=key[1]
                )
            prompts.append(prompt)
            params.append(by_key[key])
            indices.append(i)
        if not prompts:
            return results
        try:
            outputs = self.llm.generate(
                prompts, params[0] if len(by_key) == 1 else params, use_tqdm=False, lora_request=self._adapter
            )
        except ValueError:
            # vLLM validates a whole call up front; run one at a time so only the bad request fails.
            outputs = [self._generate_one(prompt, param, results[i]) for prompt, param, i in zip(prompts, params, indices)]
        for i, output in zip(indices, outputs, strict=True):
            if output is None:
                continue
            results[i].prompt_token_ids = list(output.prompt_token_ids)
            results[i].completions = [self._completion(c) for c in output.outputs]
        return results

    def _generate_one(self, prompt: dict[str, Any], params: Any, result: GenerationResult) -> Any:
        try:
            return self.llm.generate([prompt], params, use_tqdm=False, lora_request=self._adapter)[0]
        except ValueError as exc:
            result.error = f"request {result.request_id}: vLLM refused the request: {exc}"
            return None

    def _completion(self, output: Any) -> Completion:
        token_ids = list(output.token_ids)
        stopped = output.finish_reason == "stop"
        return Completion(
            text=self._decode(token_ids, stopped),
            token_ids=token_ids,
            logprobs=vllm_compat.sampled_logprobs(token_ids, output.logprobs),
            finish_reason="stop" if stopped else "length",
        )

    def _decode(self, token_ids: list[int], stopped: bool) -> str:
        """A completion's text, decoded once (vLLM runs with detokenize=False), as vLLM's detokenizer writes it.

        vLLM leaves out the stop token that ended a completion and skips special tokens; a fast tokenizer's
        decode there does not clean up spaces, so neither does this. Its incremental decode holds back text that
        ends in U+FFFD (bytes of a character not yet complete) and never writes what is still held at the end:
        a completion cut inside a character ends before it here too.
        """
        if stopped and token_ids and token_ids[-1] in self.stop_token_ids:
            token_ids = token_ids[:-1]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text.rstrip("\ufffd")

    def weight_names(self) -> frozenset[str]:
        """Hugging Face parameter and buffer names of this model (from its class on the meta device; no memory).

        An FP8 engine also takes `<weight>_scale_inv` beside each weight it runs in FP8.
        """
        if self._weight_names is None:
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

            from physreason.models.fp8 import SCALE_SUFFIX, is_fp8_weight

            loader = AutoModelForImageTextToText if self.is_vl else AutoModelForCausalLM
            with torch.device("meta"):
                model = loader.from_config(self.hf_config, trust_remote_code=self.model_config.trust_remote_code)
            names = frozenset(n for n, _ in model.named_parameters()) | frozenset(n for n, _ in model.named_buffers())
            if self.quantization is not None:
                names |= frozenset(n + SCALE_SUFFIX for n in names if is_fp8_weight(n))
            self._weight_names = names
            self._linear_names = frozenset(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        return self._weight_names

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face names) into the running engine; drop its prefix and encoder caches."""
        self._check_open()
        weights = list(named_tensors)
        # Checked before loading: vLLM stops half-way on an unknown name and leaves the model unusable.
        unknown = [name for name, _ in weights if name not in self.weight_names()]
        if unknown:
            raise PhysReasonError(
                f"update_weights got {len(unknown)} tensor(s) the engine's model does not have, e.g. {unknown[:3]}: "
                "send the policy's Hugging Face-named state dict"
            )
        if self.quantization is not None:
            _check_fp8_push(weights)
        vllm_compat.reload_weights(self.llm, weights, in_place=bool(self._loads_in_place))
        if self.quantization is not None and self._loads_in_place is None:  # the first push: may the next ones copy?
            self.in_place_refusal = vllm_compat.in_place_refusal(self.llm, weights)
            self._loads_in_place = self.in_place_refusal is None
            log.info("FP8 rollout weights: later pushes %s", "copy into the live model" if self._loads_in_place
                     else f"go through vLLM's reload_weights ({self.in_place_refusal})")  # fmt: skip
        vllm_compat.reset_caches(self.llm)
        self._weights_loaded = True

    @property
    def pushes_in_place(self) -> bool:
        """Whether `update_weights` copies into the live parameters (bf16 engines on CUDA; FP8 ones once their first
        push showed vLLM's post-load processing leaves the loaded tensors as they are)."""
        return bool(self._loads_in_place) or (self.quantization is None and vllm_compat.copies_in_place(self.llm))

    @property
    def serves_adapters(self) -> bool:
        """True when the engine was built with a LoRA slot (lora_rank or engine.lora)."""
        return self._adapter_slot

    def load_adapter(self, path: str) -> None:
        """Serve the PEFT adapter in `path` from the next generate on; the previous one is dropped from vLLM's cache.

        Each call is a new adapter version under a new id (vLLM caches adapters by id).
        """
        self._check_open()
        if not self.serves_adapters:
            raise PhysReasonError(
                "this vLLM engine was built without a LoRA slot: create it with lora_rank (or engine.lora) to load adapters"
            )
        self._adapter_versions += 1
        request = vllm_compat.lora_request(f"adapter-{self._adapter_versions}", self._adapter_versions, str(path))
        vllm_compat.add_lora(self.llm, request)
        if self._adapter is not None:
            vllm_compat.remove_lora(self.llm, self._adapter.lora_int_id)
        self._adapter = request

    def _release(self) -> None:
        """Stop vLLM's engine core, tear down the process groups it made here, and free the model and KV cache.

        vLLM's process-wide distributed state goes too (vllm_compat.shutdown_llm): another vLLM engine alive in this
        process stops working, and a new one sets that state up again.
        """
        try:
            vllm_compat.shutdown_llm(self.llm)
        finally:
            del self.llm  # the engine's only reference: the model and KV cache are freed below
            self._adapter = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
