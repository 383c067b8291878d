"""The transformers engine: batched generation for Qwen2.5-VL and Qwen3-VL (video, image, text) on CPU or GPU."""

from __future__ import annotations

import gc
import inspect
import logging
from collections.abc import Iterable

import torch
import transformers
from packaging.version import Version
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from physreason.config import EngineConfig, ModelConfig, SamplingConfig
from physreason.engines.base import Completion, Engine, GenerationRequest, GenerationResult, sampling_seed
from physreason.errors import PhysReasonError
from physreason.models import loading
from physreason.models.family import model_family, vision_special_token_ids
from physreason.models.inputs import (
    VisualInputs,
    concat_visuals,
    encode_visuals,
    load_processor_params,
)

log = logging.getLogger(__name__)

# transformers before 5.18 truncates Qwen2.5-VL's seconds per temporal patch to an integer when it builds the
# video mrope positions (`int(second_per_grid_ts)`): at 4 fps (0.5 s per patch) every frame pair of a clip
# gets the same temporal position, so generation no longer sees the frames' order. Training and scoring use
# physreason's own positions (physreason/models/positions.py), which follow the model's definition.
FIRST_GOOD_VIDEO_ROPE = Version("5.18.0")


def video_rope_problem(version: str = transformers.__version__) -> str | None:
    """Why this transformers cannot generate from video prompts correctly, or None when it can."""
    if Version(version) >= FIRST_GOOD_VIDEO_ROPE:
        return None
    return (
        f"transformers {version} builds wrong video positions for Qwen2.5-VL generation (it truncates the seconds "
        "per frame pair to an integer: at 4 fps every frame pair gets the same temporal position); install "
        f"transformers>={FIRST_GOOD_VIDEO_ROPE} or use the vllm engine"
    )


# The static-cache path pads prompts to a multiple of this, so batches of similar prompts share one
# cache shape and reuse one compiled forward instead of compiling again for every prompt length.
_STATIC_LENGTH_BUCKET = 64


class SampledLogprobs(LogitsProcessor):
    """Records the log-probability of each sampled token under the raw logits, one [B, vocab] step at a time.

    Placed first among the logits processors, so it sees the model's logits before any penalty or
    warper. The token sampled from step t's scores is known only at step t + 1 (the last column of
    `input_ids`), so each call gathers the previous step; `finish` gathers the last one.
    """

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None  # [B, vocab] log-softmax of the last step's raw logits
        self.steps: list[torch.Tensor] = []  # each [B]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(-1, input_ids[:, -1:])[:, 0])
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, steps] log-probabilities, given the [B] tokens sampled at the last step."""
        if self.previous is None:
            return torch.zeros(last_tokens.shape[0], 0)
        self.steps.append(self.previous.gather(-1, last_tokens[:, None].to(self.previous.device))[:, 0])
        return torch.stack(self.steps, dim=1)


class RowSeededSampler(LogitsProcessor):
    """Draws each row's token from a generator of its own and leaves only that token (placed last).

    transformers draws all rows of a generate call from one stream, so a row's tokens depend on the rows beside
    it; here row r draws from torch.Generator(seeds[r]) after temperature, top-k and top-p as transformers applies
    them. Every row draws once per step, finished or not, so draw t of a row is always its generator's t-th,
    whatever the batch's size, order, padding or the step at which other rows stop. The scores it returns are -inf
    except at the drawn token, which is then the only one transformers' own sampling (temperature 1, no top-k or
    top-p) can take.
    """

    def __init__(self, seeds: list[int], sampling: SamplingConfig, device: torch.device) -> None:
        warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k > 0:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1)  # [B, vocab]
        picked = torch.cat(
            [torch.multinomial(probs[row], 1, generator=gen) for row, gen in enumerate(self.generators)]
        )  # [B]
        return torch.full_like(scores, float("-inf")).scatter_(-1, picked[:, None], 0.0)


class SuppressTokens(LogitsProcessor):
    """Sets the scores of the given token ids to -inf, so sampling never draws them (placed after the recorder)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # Out of place: generate keeps the raw logits it returns in the very tensor it hands the processors.
        return scores.index_fill(-1, torch.tensor(self.token_ids, device=scores.device), float("-inf"))


class OutputPenalties(LogitsProcessor):
    """vLLM's presence and frequency penalties: logit -= frequency x count + presence x (count > 0).

    Counted over the tokens generated so far only (the columns after the left-padded prompt of
    `prompt_width`), as vLLM and the OpenAI API define them; the repetition penalty, which also counts the
    prompt, is transformers' own processor.
    """

    def __init__(self, presence: float, frequency: float, prompt_width: int) -> None:
        self.presence = presence
        self.frequency = frequency
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_width :]  # [B, steps so far]
        counts = torch.zeros_like(scores).scatter_add_(
            -1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )  # [B, vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def merge_adapter(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The transformers model with the PEFT LoRA adapter in `path` merged into its weights (PEFT's merge_and_unload).

    Generation then runs at the base model's speed, with the same parameter names, so weight pushes still apply.
    """
    from peft import PeftModel

    from physreason.models.lora import quiet_peft_wrap, read_adapter_config

    read_adapter_config(path)
    with quiet_peft_wrap():
        return PeftModel.from_pretrained(model, path).merge_and_unload().eval()


class HFEngine(Engine):
    """Generation with transformers `generate`; one batch of `engine.batch_size` requests at a time.

    `static_cache=True` decodes with a static KV cache, which transformers compiles (CUDA graphs) on
    GPU, and records log-probabilities step by step instead of keeping every step's logits (see
    bench/RESULTS.md for its speed). It compiles once per cache shape, so it pays off for repeated
    batches of similar prompts (rollouts, evaluation), not for one-off requests.
    """

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        device: str | torch.device | None = None,
        static_cache: bool = False,
    ) -> None:
        self.model_config = model
        self.engine_config = engine
        self.static_cache = static_cache
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        source = model.model_name_or_path
        hf_config = loading.load_model_config(model)
        self.is_vl = model_family(hf_config).is_vision_language
        if engine.lora is not None:  # before the weights load: a wrong adapter fails in a second
            from physreason.models.lora import check_adapter_base

            check_adapter_base(engine.lora, hf_config, model.model_name_or_path)
        self.model = loading.load_model(model, device=self.device).eval()
        if engine.lora is not None:
            self.model = merge_adapter(self.model, engine.lora)
        self.tokenizer = loading.load_tokenizer(model)
        self.tokenizer.padding_side = "left"
        self.processor_params = load_processor_params(source, model.revision) if self.is_vl else None
        self.max_model_len = engine.max_model_len or model.model_max_length
        self.video_problem = video_rope_problem() if hf_config.model_type == "qwen2_5_vl" else None
        if self.video_problem:
            log.warning("video requests will be refused: %s", self.video_problem)
        # transformers >= 5.2x builds Qwen2.5-VL's 3D (mrope) positions only from mm_token_type_ids;
        # without them video and image prompts silently get 1D positions. Older releases find the
        # vision tokens themselves and reject the argument.
        self.vision_token_types = (
            {hf_config.image_token_id: 1, hf_config.video_token_id: 2}
            if self.is_vl and "mm_token_type_ids" in inspect.signature(self.model.forward).parameters
            else None
        )
        eos = self.model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos_token_ids = set(eos_ids) | {self.tokenizer.eos_token_id}
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos_ids[0]

    def _encode(self, request: GenerationRequest) -> tuple[list[int], VisualInputs]:
        """Render the chat template, expand vision placeholders and tokenize one request."""
        if (request.images or request.videos) and not self.is_vl:
            raise PhysReasonError(
                f"request {request.request_id}: model {self.model_config.model_name_or_path} is text-only "
                "and cannot take images or videos"
            )
        if request.videos and self.video_problem:
            raise PhysReasonError(f"request {request.request_id}: {self.video_problem}")
        if not self.is_vl:
            visuals = VisualInputs()
        elif request.encoded is not None and request.encoded[0] == self.processor_params:
            visuals = request.encoded[1]  # patchified by the caller with this model's processor parameters
        else:
            visuals = encode_visuals(request.images, request.videos, self.processor_params)
        text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        text = visuals.expand(text)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) >= self.max_model_len:
            visual = sum(visuals.image_token_counts) + sum(visuals.video_token_counts)
            fix = "lower --fps or --total-pixels/--max-pixels" if visual else "shorten the question"
            raise PhysReasonError(
                f"request {request.request_id}: the prompt has {len(ids)} tokens ({visual} of them visual) but the context "
                f"is {self.max_model_len}: {fix}, or raise model.model_max_length / engine.max_model_len"
            )
        return ids, visuals

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, *, logprobs: bool = True
    ) -> list[GenerationResult]:
        """Return one result per request in order; a request that cannot be encoded gets an error, not an exception."""
        self._check_open()
        results: list[GenerationResult] = [GenerationResult(request_id=r.request_id) for r in requests]
        encoded: list[tuple[int, list[int], VisualInputs]] = []
        for i, request in enumerate(requests):
            try:
                ids, visuals = self._encode(request)
            except PhysReasonError as exc:
                results[i].error = str(exc)
                continue
            results[i].prompt_token_ids = ids
            encoded.append((i, ids, visuals))
        size = self.engine_config.batch_size
        # Requests seeded by identity (GenerationRequest.seed) are batched apart from the rest, whose rows keep
        # drawing from the call's shared stream; without any, the batches are those of one list.
        seeds = [sampling_seed(sampling, request) for request in requests]
        shared = [item for item in encoded if seeds[item[0]] is None]
        own = [item for item in encoded if seeds[item[0]] is not None]
        batches = [group[start : start + size] for group in (shared, own) for start in range(0, len(group), size)]
        for batch in batches:
            row_seeds = [seeds[index] for index, _, _ in batch] if seeds[batch[0][0]] is not None else None
            try:
                outputs = self._generate_batch(
                    [ids for _, ids, _ in batch], [v for _, _, v in batch], sampling, logprobs, row_seeds
                )
            except torch.OutOfMemoryError as exc:
                for index, _, _ in batch:
                    results[index].error = (
                        f"out of memory while generating ({exc}): lower engine.batch_size, --total-pixels or --max-tokens"
                    )
                continue
            for (index, _, _), completions in zip(batch, outputs, strict=True):
                results[index].completions = completions
        return results

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        visuals: list[VisualInputs],
        sampling: SamplingConfig,
        want_logprobs: bool,
        request_seeds: list[int] | None = None,
    ) -> list[list[Completion]]:
        """Completions of one batch; with `request_seeds` (one per prompt, sampling_seed) completion k of prompt i
        draws from request_seeds[i] + k (RowSeededSampler), else every row from the shared stream."""
        longest = max(len(p) for p in prompts)
        max_new = min(sampling.max_tokens, self.max_model_len - longest)
        width = -(-longest // _STATIC_LENGTH_BUCKET) * _STATIC_LENGTH_BUCKET if self.static_cache else longest
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)  # [B, L], left-padded
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        kwargs = {k: v.to(self.device) for k, v in concat_visuals(visuals).model_kwargs().items()}
        if self.vision_token_types is not None:
            kwargs["mm_token_type_ids"] = self.mm_token_type_ids(input_ids).to(self.device)
        for key in ("pixel_values", "pixel_values_videos"):
            if key in kwargs:
                kwargs[key] = kwargs[key].to(self.model.dtype)
        greedy = sampling.temperature == 0.0
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        seeded = None
        if request_seeds is not None and not greedy:
            # rows in transformers' order: prompt i's n completions side by side (num_return_sequences)
            rows = [seed + k for seed in request_seeds for k in range(sampling.n)]
            seeded = RowSeededSampler(rows, sampling, self.device)
        common = dict(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            **kwargs,
            do_sample=not greedy,
            temperature=None if greedy else 1.0 if seeded else sampling.temperature,
            top_p=None if greedy else 1.0 if seeded else sampling.top_p,
            top_k=None if greedy or (seeded is None and sampling.top_k < 0) else 0 if seeded else sampling.top_k,
            max_new_tokens=max_new,
            num_return_sequences=sampling.n,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )
        if sampling.ignore_eos:
            # transformers has no "sample past EOS": masking EOS until max_new tokens gives the same lengths.
            common["min_new_tokens"] = max_new
        suppressed = vision_special_token_ids(self.model.config) if sampling.suppress_vision_tokens else []
        penalties: list[LogitsProcessor] = []
        if sampling.presence_penalty or sampling.frequency_penalty:
            penalties.append(OutputPenalties(sampling.presence_penalty, sampling.frequency_penalty, width))
        if self.static_cache:
            recorder = SampledLogprobs() if want_logprobs else None
            processors = LogitsProcessorList([recorder] if recorder else [])
            if sampling.repetition_penalty != 1.0:  # after the recorder, so it records the raw distribution
                processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
            processors.extend(penalties)
            if suppressed:
                processors.append(SuppressTokens(suppressed))
            if seeded is not None:
                processors.append(seeded)
            out = self.model.generate(
                **common, repetition_penalty=1.0, logits_processor=processors, cache_implementation="static"
            )
            new_tokens = out.sequences[:, width:]  # [B * n, new]
            logprobs = recorder.finish(new_tokens[:, -1]).cpu() if recorder else None  # [B * n, new]
            new_tokens = new_tokens.cpu()
        else:
            # Per-step logits only when asked: [B * n, new, vocab] would dominate memory for long generations.
            out = self.model.generate(
                **common,
                repetition_penalty=sampling.repetition_penalty,
                output_logits=want_logprobs,
                logits_processor=LogitsProcessorList(
                    penalties + ([SuppressTokens(suppressed)] if suppressed else []) + ([seeded] if seeded else [])
                ),
            )
            new_tokens = out.sequences[:, width:].cpu()  # [B * n, new]
            logprobs = None
            if want_logprobs:
                logits = torch.stack(out.logits, dim=1).float()  # [B * n, new, vocab] raw, before sampling processors
                picked = new_tokens[..., None].to(logits.device)
                logprobs = torch.log_softmax(logits, dim=-1).gather(-1, picked)[..., 0].cpu()
        grouped: list[list[Completion]] = []
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            end = None if sampling.ignore_eos else next((k + 1 for k, t in enumerate(tokens) if t in self.eos_token_ids), None)
            finish = "stop" if end is not None else "length"
            tokens = tokens[: end if end is not None else len(tokens)]
            completion = Completion(
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                token_ids=tokens,
                logprobs=logprobs[row, : len(tokens)].tolist() if logprobs is not None else [],
                finish_reason=finish,
            )
            if row % sampling.n == 0:
                grouped.append([])
            grouped[-1].append(completion)
        return grouped

    def mm_token_type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token kinds for mrope: 0 text, 1 image placeholder, 2 video placeholder."""
        types = torch.zeros_like(input_ids)
        for token_id, kind in (self.vision_token_types or {}).items():
            types[input_ids == token_id] = kind
        return types

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights into the model in place, by Hugging Face parameter name."""
        self._check_open()
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = []
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                unknown.append(name)
                continue
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if unknown:
            raise PhysReasonError(
                f"update_weights got {len(unknown)} tensor(s) the engine's model does not have, e.g. {unknown[:3]}: "
                "send the policy's Hugging Face-named state dict"
            )

    def _release(self) -> None:
        """Drop the model and free its memory.

        What the static-cache path leaves behind lives on the model and goes with it: the compiled forward
        (transformers' `_compiled_call`) and any cache transformers keeps between generate calls.
        """
        del self.model
        gc.collect()  # the compiled forward and the model refer to each other
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
