"""Typed settings for every physreason job, one pydantic model per TOML section.

Key names follow cosmos-rl's TOML where they mean the same thing, so recipes port with few edits.
Every model forbids unknown keys: a misspelt key is an error that names it, never a silent default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# Bounds every number of every section obeys (narrower ones are written on the field): an integer must fit the
# 64-bit integers that torch, numpy and the OS take (a 400-digit max_steps otherwise passes here and fails mid-run
# with OverflowError), a float must be finite (allow_inf_nan=False below).
INT_LIMIT = 2**63
# Seconds of a timeout or wait: threading's waits refuse more than about 9.2e9 (threading.TIMEOUT_MAX).
MAX_SECONDS = 1e9


def _out_of_range_int(value: Any) -> bool:
    """Whether an integer anywhere in value (a list, tuple or dict's values included) is outside +-(INT_LIMIT - 1)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -INT_LIMIT < value < INT_LIMIT
    if isinstance(value, list | tuple):
        return any(_out_of_range_int(item) for item in value)
    if isinstance(value, dict):
        return any(_out_of_range_int(item) for item in value.values())
    return False


class Section(BaseModel):
    """Base for all config sections: unknown keys are errors; assignments are validated; numbers are bounded."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _integers_fit_64_bits(cls, value: Any) -> Any:
        if _out_of_range_int(value):
            raise ValueError("integers here must lie between -(2**63 - 1) and 2**63 - 1")
        return value


class ModelConfig(Section):
    """Which checkpoint to load and how."""

    model_name_or_path: str = Field(
        "nvidia/Cosmos-Reason1-7B", description="Hugging Face hub id or local folder of the model."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit); None is the default branch.")
    model_max_length: int = Field(
        10240, gt=0, description="Longest sequence (prompt + response) in tokens that training and engines accept."
    )
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = Field(
        "bfloat16", description="Parameter dtype when loading; 'auto' keeps the checkpoint's dtype."
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Attention kernel used by the transformers model."
    )
    grouped_vision_attention: bool = Field(
        True,
        description="Run the Qwen2.5-VL vision tower's sdpa/eager attention as one batched call per window length "
        "instead of one per window (same result, far fewer kernel launches); false keeps transformers' own loop.",
    )
    trust_remote_code: bool = Field(
        False, description="Run code shipped with the checkpoint. Off unless you trust the checkpoint's source."
    )


class TokenSampling(Section):
    """How each token is drawn; the defaults are Cosmos-Reason1's published inference defaults."""

    temperature: float = Field(0.6, ge=0.0, description="Softmax temperature; 0 means greedy decoding.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Keep the k most likely tokens; -1 keeps all.")
    repetition_penalty: float = Field(
        1.05, gt=0.0, description="Divides positive logits (multiplies negative) of tokens in the prompt or output (1.0 = off)."
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logit of every token already in the completion (vLLM/OpenAI semantics; "
        "0 = off; Cosmos-Reason2's non-reasoning default is 1.5).",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit once per time it occurs in the completion (vLLM/OpenAI; 0 = off).",
    )
    seed: int | None = Field(None, description="Sampling seed; None draws a fresh one each run.")
    ignore_eos: bool = Field(
        False,
        description=(
            "Every completion runs to max_tokens (benchmarks): vLLM samples on past end-of-sequence tokens, "
            "the hf engine never samples them."
        ),
    )
    suppress_vision_tokens: bool = Field(
        False,
        description=(
            "Never sample the image/video placeholder tokens (a vision-language model's pads, vision start and end): "
            "for models trained from random weights and benchmarks. Log-probabilities stay those of the raw logits."
        ),
    )


class SamplingConfig(TokenSampling):
    """Sampling settings of a generate call: how tokens are drawn, how many, how many completions."""

    max_tokens: int = Field(4096, gt=0, description="Most new tokens per completion.")
    n: int = Field(1, ge=1, description="Completions per request.")


class RolloutSamplingConfig(TokenSampling):
    """[rollout.sampling_config]: how GRPO rollouts draw tokens.

    The group size and the completion length are `[rollout] n_generation` and `max_response_length`
    (one source each): `n` and `max_tokens` here are errors that name those keys.
    """


class VisionConfig(Section):
    """Frame sampling and pixel budgets (qwen-vl-utils' rules; sides become multiples of the model's patch factor).

    The pixel budgets default to None: a number of visual tokens times the square of the model's patch factor
    (patch x spatial merge: 28 for Qwen2.5-VL / Cosmos-Reason1, 32 for Qwen3-VL / Cosmos-Reason2), the
    defaults of qwen-vl-utils for both families (see physreason.vision.resize.pixel_budgets).
    """

    fps: float = Field(4.0, gt=0.0, description="Frames per second sampled from each video.")
    min_frames: int = Field(4, ge=2, description="Fewest frames sampled from a video (rounded up to even).")
    max_frames: int = Field(768, ge=2, description="Most frames sampled from a video (rounded down to even).")
    min_pixels: int | None = Field(
        None, gt=0, description="Smallest area (pixels) of one video frame after resizing; None: 128 tokens' worth."
    )
    max_pixels: int | None = Field(
        None, gt=0, description="Largest area (pixels) of one video frame after resizing; None: 768 tokens' worth."
    )
    total_pixels: int | None = Field(
        None,
        gt=0,
        description="Pixel budget of a whole video, shared over its frames; None: 8192 tokens' worth "
        "(8192*28*28 for Qwen2.5-VL, 8192*32*32 for Qwen3-VL).",
    )
    image_min_pixels: int | None = Field(
        None, gt=0, description="Smallest area (pixels) of an image after resizing; None: 4 tokens' worth."
    )
    image_max_pixels: int | None = Field(
        None, gt=0, description="Largest area (pixels) of an image after resizing; None: 16384 tokens' worth."
    )
    timestamps: bool = Field(
        False,
        description="Draw each frame's time under it in a black bar one patch factor high (Cosmos-Reason1's "
        "overlay); Qwen3-VL models get each frame pair's time as text whatever this says.",
    )
    nframes: int | None = Field(
        None,
        ge=2,
        description="Fixed number of frames per video, rounded to even as qwen-vl-utils does; when set, fps, "
        "min_frames and max_frames are not used.",
    )
    video_start: float | None = Field(
        None, ge=0.0, description="Seconds: sample frames from this time on (a data record's video_start wins)."
    )
    video_end: float | None = Field(
        None, gt=0.0, description="Seconds: sample frames up to this time (a data record's video_end wins)."
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> VisionConfig:
        if self.video_start is not None and self.video_end is not None and self.video_start >= self.video_end:
            raise ValueError(f"video_start ({self.video_start}) must be before video_end ({self.video_end})")
        for low, high in (("min_frames", "max_frames"), ("min_pixels", "max_pixels"),
                          ("image_min_pixels", "image_max_pixels")):  # fmt: skip
            lower, upper = getattr(self, low), getattr(self, high)
            if lower is not None and upper is not None and lower > upper:
                raise ValueError(f"{low} ({lower}) must not exceed {high} ({upper})")
        return self


class PromptConfig(Section):
    """[prompt]: how questions are put to the model: the prompt style of its generation and the reasoning switch.

    One setting for every job that builds a prompt (infer, batch and Ray inference, eval, SFT rendering, GRPO
    prompts, serve). Generation settings a recipe leaves out take the style's defaults for the mode.
    """

    style: Literal["auto", "reason1", "reason2"] = Field(
        "auto",
        description="'reason1': Cosmos-Reason1's prompts (reasoning format in the system prompt, <answer> tags); "
        "'reason2': Cosmos-Reason2's (system 'You are a helpful assistant.', reasoning instruction appended to the "
        "user text, answer right after </think>); 'auto' reads the checkpoint's config: Qwen3-VL -> reason2, "
        "anything else -> reason1.",
    )
    reasoning: bool | None = Field(
        None,
        description="Ask for <think> reasoning before the answer; None takes the style's default (reason1: on, "
        "reason2: off, as cosmos-reason2's inference script).",
    )
    system_prompt: str | None = Field(
        None,
        description="Replace the style's system prompt for inference, eval and serve; '' sends no system message.",
    )


class EngineConfig(Section):
    """Which generation engine serves inference, evaluation and rollouts, and its options."""

    backend: Literal["auto", "vllm", "hf"] = Field("auto", description="'auto' uses vLLM when it is importable.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine spans (vLLM).")
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may take.")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length of the engine; None uses model_max_length."
    )
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=lambda: {"image": 4, "video": 1}, description="Most images/videos in one prompt (vLLM)."
    )
    enforce_eager: bool = Field(False, description="Disable CUDA graphs in vLLM (slower; less memory, faster start).")
    cuda_graph_sizes: Literal["vllm", "batch"] = Field(
        "vllm",
        description="Batch sizes vLLM captures CUDA graphs for at start: 'vllm' its own list (about 50 sizes up to 512 "
        "sequences); 'batch' engine.batch_size and the powers of two below it (a batch's tail, as requests finish, "
        "runs in the next larger graph): fewer graphs, a shorter start, for runs whose generate calls send at most "
        "engine.batch_size requests (batch inference, evaluation). GRPO's vLLM rollouts size it by a round's "
        "completions instead (rollout.batch_size x rollout.n_generation). Unused with enforce_eager.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="vLLM's KV cache storage (vLLM's argument): 'auto' keeps model.dtype; 'fp8' stores keys and values "
        "as float8_e4m3 with per-tensor scales of 1.0 (no calibration), halving the cache a decode step reads; with "
        "FlashAttention 3 (Hopper) queries are quantized to FP8 too. With or without rollout.quantization = 'fp8'. "
        "Needs vLLM. Accuracy: values beyond +-448 saturate and tiny ones lose precision (docs/fp8.md).",
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description="GiB of KV cache vLLM reserves, skipping its memory profiling (vLLM's kv_cache_memory_bytes); None "
        "sizes the cache from gpu_memory_utilization. For several engines sharing one GPU (experiment seeds side by "
        "side): vLLM's profiling stops when another process frees GPU memory meanwhile. gpu_memory_utilization "
        "still has to be free at start.",
    )
    batch_size: int = Field(8, ge=1, description="Requests per generate call of the hf engine.")
    hf_static_cache: bool = Field(
        False, description="hf engine: static KV cache + torch.compile on GPU (compiles once per batch shape)."
    )
    lora: str | None = Field(
        None,
        description="A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) served on top of "
        "the model: vLLM loads it as a runtime adapter, the hf engine merges it in when loading. None: the model alone.",
    )

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        """kv_cache_memory_gib in bytes, as vLLM takes it (None: vLLM sizes the cache)."""
        return None if self.kv_cache_memory_gib is None else int(self.kv_cache_memory_gib * 2**30)


class DatasetConfig(Section):
    """Where a data set lives: a JSON/JSONL/parquet file, a load_from_disk folder, or a hub name."""

    name: str = Field("", description="Path to a JSON/JSONL/parquet file or dataset folder, or a Hugging Face dataset name.")
    subset: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    split: str = Field("train", description="Split to read.")
    media_root: str | None = Field(
        None, description="Folder that media paths in records are relative to; default: the data file's folder."
    )


class DataConfig(Section):
    """Training data and how it is batched."""

    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    val_dataset: DatasetConfig | None = Field(None, description="Held-out split for validation loss; None = none.")
    val_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Fraction of the train set held out when no val_dataset."
    )
    conversation_column_name: str = Field("conversations", description="Record key holding the chat turns (SFT).")
    shuffle: bool = Field(True, description="Shuffle the training order each epoch.")
    packing: bool = Field(False, description="Pack several samples into one sequence (no attention across samples).")
    num_workers: int = Field(2, ge=0, description="Data loader worker processes (video decoding runs there).")
    max_samples: int | None = Field(None, gt=0, description="Use at most this many samples (debugging).")


class CheckpointConfig(Section):
    """[train.ckpt]: periodic checkpoints and Hugging Face export."""

    enable_checkpoint: bool = Field(True, description="Write checkpoints.")
    save_freq: int = Field(100, gt=0, description="Steps between checkpoints.")
    save_mode: Literal["sync", "async"] = Field(
        "sync",
        description="'sync': the step waits until the checkpoint is written; 'async': the step waits only for a copy "
        "of the state in host memory and DCP writes the files in a background thread (one write in flight; the "
        "checkpoint counts, and resume takes it, once every file is written).",
    )
    max_keep: int = Field(2, ge=1, description="Checkpoints, and safetensors exports, kept; older ones are deleted.")
    export_safetensors: bool = Field(True, description="Also export a Hugging Face safetensors folder at each save.")
    upload_s3: Literal[False, "final", "all"] = Field(
        False,
        description="Upload to S3 in the background: 'final' the last checkpoint and export of a finished run, 'all' "
        "every checkpoint and export as it is saved; false uploads nothing. Credentials and endpoint come from the "
        "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...); needs physreason[s3].",
    )
    s3_bucket: str | None = Field(None, description="S3 bucket that upload_s3 writes to (required with upload_s3).")
    s3_prefix: str | None = Field(
        None,
        description="Key prefix in s3_bucket: objects go to <s3_prefix>/checkpoints/step_<n>/... and "
        "<s3_prefix>/safetensors/step_<n>/...; None uses the name of train.output_dir's folder.",
    )
    upload_hf: bool = Field(
        False,
        description="Upload the final safetensors export to the Hugging Face Hub repo hf_repo_name when the run "
        "finishes (token from HF_TOKEN; HF_ENDPOINT picks another Hub).",
    )
    hf_repo_name: str | None = Field(
        None,
        description="Hub model repo for upload_hf: 'namespace/name', or a bare name created under the token's user; "
        "created (private) if missing.",
    )
    upload_wait_s: float = Field(
        3600.0,
        ge=0.0,
        le=MAX_SECONDS,
        description="Seconds the end of a run waits for uploads still in flight; what is left then is listed, "
        "and a resume (train.resume = true) uploads it.",
    )

    @model_validator(mode="after")
    def _check_uploads(self) -> CheckpointConfig:
        if self.upload_s3 and not self.s3_bucket:
            raise ValueError(f"upload_s3 = '{self.upload_s3}' needs s3_bucket, the bucket to upload to")
        if self.upload_hf and not self.hf_repo_name:
            raise ValueError("upload_hf = true needs hf_repo_name, the Hub repo to upload the final export to")
        if self.upload_hf and not self.export_safetensors:
            raise ValueError("upload_hf = true uploads the final safetensors export: set export_safetensors = true")
        if (self.upload_s3 or self.upload_hf) and not self.enable_checkpoint:
            raise ValueError(
                "upload_s3 / upload_hf upload checkpoints and exports, which enable_checkpoint = false turns off"
            )
        return self


class ParallelismConfig(Section):
    """How one replica's model is split over GPUs."""

    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree.")
    cp_size: int = Field(
        1,
        ge=1,
        description="Context-parallel degree: each row's tokens (and its vision patches) are split over this many "
        "processes (Ulysses attention; must divide the language model's query heads per TP rank). Processes = "
        "dp x cp_size x tp_size.",
    )
    dp_shard_size: int = Field(-1, ge=-1, description="FSDP shard degree; -1 uses all remaining GPUs.")
    n_init_replicas: int = Field(1, ge=1, description="Replicas started at launch (disaggregated RL).")


class LoraConfig(Section):
    """[train.lora]: train low-rank adapters (PEFT LoRA) instead of the full model; the base weights stay frozen."""

    enable: bool = Field(False, description="Train LoRA adapters; every base weight is frozen and only adapters train.")
    rank: int = Field(16, ge=1, description="Rank r of each adapter's A [r, in] and B [out, r] matrices.")
    alpha: float = Field(
        32.0, gt=0.0, description="Scale numerator: an adapter adds (alpha / rank) x B A to its layer's weight."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on each adapter's input in training; 0 keeps GRPO's policy log-probs deterministic.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Linear layers (last name part) that get adapters inside the language model's decoder blocks.",
    )
    vision: bool = Field(False, description="Also put adapters on the vision tower's blocks (vision_target_modules).")
    vision_target_modules: list[str] = Field(
        default_factory=lambda: ["qkv", "proj", "gate_proj", "up_proj", "down_proj", "linear_fc1", "linear_fc2"],
        description="Linear layers (last name part) of the vision blocks that get adapters when vision = true "
        "(Qwen2.5-VL: qkv, proj, gate/up/down_proj; Qwen3-VL: qkv, proj, linear_fc1/2); names a family lacks are skipped.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters and saved with them (e.g. 'lm_head'); none by default.",
    )
    sync: Literal["auto", "merged"] = Field(
        "auto",
        description="GRPO weight sync to the rollout engine: 'auto' sends the adapter alone where the engine serves "
        "runtime adapters (vLLM; language-block adapters without modules_to_save), merged weights elsewhere; "
        "'merged' always sends base + adapters merged (the engine then runs without LoRA kernels).",
    )


class Float8TrainConfig(Section):
    """[train.fp8]: float8 matmuls in the language model's linear layers (torchao), cosmos-rl's keys.

    Parameters, checkpoints and exports keep their dtype; only the matmuls run in float8 (needs a GPU of compute
    capability 8.9 or more: H100, L40S, RTX 4090 and later).
    """

    enable_fp8: bool = Field(False, description="Train the language model's linear layers with float8 matmuls.")
    fp8_recipe: Literal["dynamic_scaling"] = Field(
        "dynamic_scaling", description="Scales computed from each tensor as it is cast (the one recipe supported)."
    )
    quant_recipe: Literal["rowwise", "tensorwise"] = Field(
        "rowwise",
        description="'rowwise': one scale per row (better accuracy); 'tensorwise': one per tensor, faster, and under "
        "FSDP2 over more than one rank the weights are all-gathered in float8.",
    )
    skip_small_linears: bool = Field(
        True,
        description="Leave in bf16 the linear layers too small for float8 to beat bf16 (torchao's H100 thresholds per "
        "recipe: e.g. k_proj/v_proj); false converts every language-model linear whose sides are multiples of 16.",
    )


class TrainConfig(Section):
    """[train]: optimisation, schedule and run layout, shared by SFT and GRPO."""

    output_dir: str = Field("./outputs", description="Folder for checkpoints, logs and exports.")
    resume: bool | str = Field(
        False,
        description="true resumes from the latest checkpoint in output_dir; a path resumes from it. A folder this run "
        "did not write (outside output_dir, or linked or copied into it) needs trust_checkpoint; any checkpoint's "
        "pickled DCP metadata is read admitting only checkpoint types, so a forged one is refused, never run. A resume first writes any safetensors "
        "export that a kill left unfinished.",
    )
    resume_allow_changes: bool = Field(
        False,
        description="Let a resume change [data], [model] or train.optm_* keys from the run's config.toml (refused "
        "otherwise, naming the keys); the earlier config.toml is kept as config.before-resume-N.toml.",
    )
    trust_checkpoint: bool = Field(
        False,
        description="Allow train.resume to load a checkpoint folder this run did not write (outside output_dir, "
        "or linked or copied into it; output_dir/checkpoints/written.json lists the ones it wrote). Only for "
        "folders you trust: their weights and state come from elsewhere (pickles in them are read admitting only "
        "checkpoint types, so they run no code).",
    )
    seed: int = Field(
        42, ge=0, lt=2**32, description="Seed for data order, initialisation and sampling (numpy's range: 0 to 2**32 - 1)."
    )
    epoch: int = Field(1, ge=1, description="Passes over the training data.")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps (overrides epoch).")
    train_batch_per_replica: int = Field(
        8,
        ge=1,
        description="SFT: samples per optimizer step; GRPO: completions per step (a multiple of n_generation x dp).",
    )
    mini_batch: int = Field(
        1, ge=1, description="Samples per forward pass on one device (gradient accumulation fills the rest)."
    )
    optm_name: Literal["AdamW"] = Field("AdamW", description="Optimizer.")
    optm_lr: float = Field(1e-5, gt=0.0, description="Peak learning rate.")
    optm_weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    optm_betas: tuple[
        Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]
    ] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    optm_warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    optm_decay_type: Literal["cosine", "linear", "constant"] = Field("cosine", description="Decay after warmup.")
    optm_min_lr_factor: float = Field(0.0, ge=0.0, le=1.0, description="Final lr as a fraction of optm_lr.")
    optm_grad_norm_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm; 0 disables.")
    param_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="FSDP2 parameter dtype for compute.")
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = Field("float32", description="FSDP2 gradient reduction dtype.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in the backward pass.")
    checkpoint_every: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1,
        description="With gradient_checkpointing: recompute decoder blocks 0, n, 2n, ... only (1: every block); the "
        "others keep their activations, memory for speed. The memory plan prices it. 'auto': at the start, the "
        "fewest recomputed decoder blocks whose plan leaves a tenth of the GPU free (every block without a GPU).",
    )
    vision_checkpoint_every: int = Field(
        1,
        ge=0,
        description="With gradient_checkpointing: recompute vision-encoder blocks 0, n, 2n, ... only (1: every block; "
        "0: none, the tower keeps its activations). A video row's tower holds four patches per visual token.",
    )
    one_rank_precision: Literal["cast", "legacy"] = Field(
        "cast",
        description="How a run on one process (plain, or torchrun --nproc-per-node 1) gets param_dtype compute. "
        "'cast': no FSDP2 and no collectives; each block's float32 parameters are cast to param_dtype for its forward "
        "(FSDP2's numerics and checkpoints: a checkpoint resumes on any number of processes). 'legacy': FSDP2 on a "
        "one-rank mesh under torchrun (its all-gathers and reduce-scatters are copies), float32 weights under "
        "autocast in a plain process. train.cpu_offload always takes the legacy path; float8 (train.fp8) takes 'cast' "
        "too, its layers casting the bf16 copies.",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2 CPU offload (needs torchrun): sharded fp32 weights, gradients and AdamW state live in host "
        "memory, each block is copied to the GPU when used and the optimizer steps on the CPU (torch's fused AdamW). "
        "Slower (12 bytes per parameter over PCIe and an AdamW pass over host memory every step); frees the GPU of "
        "about 16 bytes per parameter / number of processes.",
    )
    cpu_offload_overlap: bool = Field(
        False,
        description="SFT with train.cpu_offload: the host's AdamW steps in a background thread, one FSDP2 unit at a "
        "time in forward order, while the next step's forward runs; each unit's forward waits for its own update, so "
        "the losses and weights are exactly those of the serial step. Off by default: on an H100 host of 16 threads "
        "the background AdamW slowed the forward more than it hid (bench/RESULTS.md; bench/memory_plan.py --modes "
        "offload,offload-overlap measures a host). Needs float32 optimizer state and no train.fp8.",
    )
    optimizer_state_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype AdamW keeps its two moments in: 'bfloat16' saves 4 bytes per trained parameter (the update "
        "itself is computed in float32; the second moment's decay below 1/256 of its value is rounded away).",
    )
    skip_memory_check: bool = Field(
        False,
        description="Start even when the memory plan printed at start-up says the recipe will not fit the GPUs "
        "(`physreason plan` shows the plan and the layouts that fit).",
    )
    freeze_vision_tower: bool = Field(False, description="Keep the vision encoder's weights fixed.")
    compile: bool = Field(False, description="torch.compile each decoder block.")
    compile_vision: bool = Field(
        False,
        description="torch.compile each vision-encoder block (one graph serves them all; it fuses the tower's "
        "elementwise kernels: 1.20x on Reason2's video row, H200). The first clips of new patch grids recompile, after "
        "which torch treats the sizes as dynamic and later grids reuse the graphs (a few per layout of segments).",
    )
    loss_chunk_size: int = Field(
        0, ge=0, description="Tokens per lm_head + cross-entropy chunk (full logits never materialise); 0 = one piece."
    )
    log_freq: int = Field(
        10,
        gt=0,
        description="Steps between metric logs (a console line and a JSONL/TensorBoard/wandb point; the last step "
        "always logs); the progress bar shows every step.",
    )
    validation_freq: int = Field(100, gt=0, description="Steps between validation-loss evaluations.")
    sync_weight_interval: int = Field(1, gt=0, description="GRPO: steps between weight pushes to the rollout engine.")
    ckpt: CheckpointConfig = Field(default_factory=CheckpointConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    fp8: Float8TrainConfig = Field(default_factory=Float8TrainConfig)

    @model_validator(mode="after")
    def _overlap_needs_offload(self) -> TrainConfig:
        if not self.cpu_offload_overlap:
            return self
        if not self.cpu_offload:
            raise ValueError(
                "train.cpu_offload_overlap = true overlaps the host's AdamW step of train.cpu_offload with the next forward, "
                "but train.cpu_offload = false: set train.cpu_offload = true, or train.cpu_offload_overlap = false"
            )
        if self.optimizer_state_dtype != "float32":
            raise ValueError(
                "train.cpu_offload_overlap = true steps torch's fused AdamW a unit at a time, which needs "
                "train.optimizer_state_dtype = 'float32': set it, or train.cpu_offload_overlap = false"
            )
        if self.fp8.enable_fp8:
            raise ValueError(
                "train.cpu_offload_overlap = true cannot run with train.fp8.enable_fp8 = true (float8's scales are computed "
                "from every weight right after the step): set one of them to false"
            )
        return self


class RolloutConfig(Section):
    """[rollout]: generation of GRPO samples."""

    n_generation: int = Field(8, ge=1, description="Completions sampled per prompt (the GRPO group size, 2 or more).")
    max_response_length: int = Field(6144, gt=0, description="Most tokens in one completion.")
    batch_size: int = Field(4, ge=1, description="Prompts per rollout batch.")
    sampling_config: RolloutSamplingConfig = Field(
        default_factory=lambda: RolloutSamplingConfig(temperature=1.0, top_p=1.0, repetition_penalty=1.0),
        description="Rollout sampling; its temperature is also the policy's logit temperature.",
    )
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    replica_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=MAX_SECONDS,
        description="Disaggregated GRPO: a rollout replica whose weight-channel connect, weight receive or generate "
        "call has not returned after this many seconds is taken as hung and handled as lost (killed, its prompts "
        "drawn again, a new replica started); engine start-up is not timed. Above the longest generate call.",
    )
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="Weights of the rollout engine (vLLM's argument): 'fp8' runs the language model's linear layers "
        "with float8_e4m3fn weights in 128x128 blocks, quantized from the policy at every weight push (vision tower, "
        "embeddings, norms and lm_head stay in model.dtype); turns on grpo.use_tis unless that is set. Needs vLLM.",
    )


class PolicyConfig(Section):
    """[policy]: how the trained model is laid out on GPUs."""

    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)


class GRPOConfig(Section):
    """[grpo]: the GRPO objective and its data."""

    epsilon_low: float = Field(0.2, ge=0.0, description="Lower clip range of the probability ratio.")
    epsilon_high: float = Field(0.2, ge=0.0, description="Upper clip range of the probability ratio.")
    dual_clip: float | None = Field(
        None, gt=1.0, description="Dual-clip constant c (> 1) for negative advantages; None = off."
    )
    kl_beta: float = Field(
        0.0, ge=0.0, description="Weight of the k3 KL penalty to the reference model; 0 loads no reference."
    )
    advantage: Literal["grpo", "drgrpo"] = Field(
        "grpo", description="'grpo' divides by the group std; 'drgrpo' does not."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses are reduced."
    )
    mu_iterations: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    mini_batch: int = Field(4, ge=1, description="Most completions per forward pass in the policy update.")
    mini_batch_tokens: int = Field(
        0,
        ge=0,
        description=(
            "Most tokens per forward pass in the policy update (rows x longest row, padding included); "
            "0 = no token bound. A row longer than this gets a pass of its own."
        ),
    )
    pack_completions: bool | None = Field(
        None,
        description=(
            "Policy update: one row per prompt holding the prompt once and then its completions, each "
            "completion attending to the prompt and itself (same log-probs as one padded row each, fewer tokens; "
            "needs sdpa or eager attention). Unset: on with sdpa/eager, off with a flash model.attn_implementation "
            "(flash kernels take no 4D mask); false: one padded row per completion."
        ),
    )
    packed_attention: Literal["mask", "spans"] = Field(
        "mask",
        description=(
            "How packed rows attend (grpo.pack_completions with model.attn_implementation = 'sdpa', one context "
            "rank): 'mask' runs sdpa under each row's [L, L] boolean mask; 'spans' runs the rows as variable-length "
            "sequences in one flash-attention call a layer (the prompt, then each completion against the prompt "
            "and itself: only the needed scores; models/packed_attention.py). Same log-probs and gradients; no faster "
            "at 8 prompts x 8 completions of 256 tokens on the 3B shape (H200, bench/RESULTS.md), so the mask stays the "
            "default: spans may pay where the mask's L x L memory is the limit (long prompts, many completions a row)."
        ),
    )
    dynamic_sampling: bool = Field(False, description="Drop groups whose rewards are all equal and draw more prompts.")
    mask_truncated_completions: bool = Field(
        False,
        description=(
            "Leave completions cut at rollout.max_response_length out of the loss (TRL's name; DAPO's overlong "
            "filtering); they still count in their group's advantages."
        ),
    )
    overlong_buffer_length: int = Field(
        0,
        ge=0,
        description=(
            "DAPO's soft overlong punishment: tokens before rollout.max_response_length from which a completion's "
            "reward falls linearly, to -overlong_penalty_factor at the limit (verl's overlong_buffer.len); 0 = off."
        ),
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0.0, description="Largest overlong punishment, reached at rollout.max_response_length (verl's name)."
    )
    max_dynamic_sampling_rounds: int = Field(
        8, ge=1, description="Most extra prompt draws per step with dynamic sampling."
    )
    reference_model_path: str | None = Field(
        None,
        description=(
            "KL reference model (hub id or folder); None uses model.model_name_or_path. Loaded only if kl_beta > 0."
        ),
    )
    answer_type: Literal["grpo", "reasoning", "letter"] = Field(
        "grpo", description="Prompt wording: Cosmos-Reason1's RL recipe ('grpo'), or the benchmark's reasoning/letter."
    )
    shuffle_options: bool = Field(
        True, description="Reshuffle multiple-choice options per sample, remapping the answer."
    )
    reward_function: dict[str, float] = Field(
        default_factory=lambda: {"accuracy": 1.0, "format": 1.0}, description="Reward name -> weight."
    )
    reward_options: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description=(
            "Reward name -> its options, for rewards that take some (checked when GRPO starts). The IoU rewards "
            "(box_iou, temporal_iou, localization) take hit_weight and hit_threshold: reward = (1 - hit_weight) x IoU "
            "+ hit_weight x [IoU >= hit_threshold]; e.g. localization = {hit_weight = 1.0} pays the hit at IoU 0.5 "
            "alone. Unset: the continuous IoU."
        ),
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Probability ratio per token (GRPO) or per sequence (GSPO)."
    )
    kl_importance_correction: bool = Field(
        False, description="Weight the k3 KL term by the policy/old ratio (TRL's use_bias_correction_kl)."
    )
    use_tis: bool | None = Field(
        None,
        description="Truncated importance sampling: weight each token's policy loss by min(pi_old / pi_rollout, "
        "tis_imp_ratio_cap), pi_rollout being the engine's own log-prob of the sampled token (corrects the gap "
        "between engine and policy, e.g. FP8 rollouts). None: on when rollout.quantization = 'fp8', else off. "
        "Needs rollout.sampling_config.temperature = 1 (engines report temperature-1 log-probs).",
    )
    tis_imp_ratio_cap: float = Field(
        2.0, gt=0.0, description="Cap C of the truncated importance weight (verl's name; its FP8 recipe uses 2)."
    )
    mode: Literal["colocated", "disaggregated"] = Field(
        "colocated", description="Share GPUs, or separate replicas on Ray."
    )
    allowed_outdated_steps: int = Field(1, ge=0, description="Disaggregated: oldest weight version a rollout may use.")


class LoggingConfig(Section):
    """[logging]: where metrics go."""

    logger: list[Literal["console", "tensorboard", "jsonl", "wandb"]] = Field(
        default_factory=lambda: ["console", "tensorboard", "jsonl"], description="Metric sinks."
    )
    project_name: str = Field("physreason", description="Project name (wandb).")
    experiment_name: str | None = Field(None, description="Run name; None derives one from the time.")


class EvalConfig(Section):
    """[eval]: benchmark evaluation."""

    benchmark_root: str = Field("", description="Folder holding <name>/<name>_benchmark_qa_pairs.json per dataset.")
    datasets: list[str] = Field(
        default_factory=list,
        description="Dataset names under benchmark_root, JSON/JSONL/parquet files, dataset folders (Physical AI "
        "Bench snapshots) or Hub dataset ids.",
    )
    answer_type: Literal["reasoning", "letter"] | None = Field(
        None,
        description="Think then answer ('reasoning'), or the answer only ('letter'); the results folder is "
        "'reasoning', or without reasoning the task type ('letter', 'grounding', 'localization'). "
        "None follows prompt.reasoning (itself the prompt style's default when unset); setting both to "
        "different modes is an error.",
    )
    num_repeats: int = Field(1, ge=1, description="Independent runs with different seeds; mean and std are reported.")
    seed: int = Field(1, description="Seed of the first repeat; repeat k uses seed + k.")
    model_name: str | None = Field(
        None, description="Name of the results folder for this model; None derives it from model_name_or_path."
    )
    limit: int | None = Field(None, gt=0, description="Evaluate at most this many questions per data set (debugging).")
    results_dir: str = Field(
        "./results", description="Per-sample results go under <results_dir>/<model>/<answer_type>/<dataset>/."
    )
    num_gpus: int = Field(1, ge=1, description="GPUs used in all; shards = num_gpus / tp_size.")
    tp_size: int = Field(1, ge=1, description="GPUs per engine.")

    @model_validator(mode="after")
    def _check_shards(self) -> EvalConfig:
        if self.num_gpus % self.tp_size:
            raise ValueError(f"num_gpus ({self.num_gpus}) must be a multiple of tp_size ({self.tp_size})")
        return self


class InferConfig(Section):
    """[infer]: batch inference (`physreason infer --jsonl|--parquet IN --out OUT`)."""

    num_gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs of a Ray Data run: num_gpus / engine.tensor_parallel_size engine replicas, media decoded "
        "on CPU workers. None answers the batch with one engine in this process.",
    )
    device: Literal["auto", "gpu", "cpu"] = Field(
        "auto",
        description="Where Ray Data replicas run: 'gpu' needs num_gpus GPUs in the cluster; 'cpu' runs the same "
        "number of replicas without GPUs (tests, CPU clusters); 'auto' is 'gpu' when the cluster has any GPU.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster to join ('auto' or host:port of `ray start --head`); None uses RAY_ADDRESS when "
        "set, else starts Ray on this machine.",
    )
    decode_workers: int | None = Field(
        None,
        ge=0,
        description="One-engine runs (num_gpus None): threads that decode the next batch's media while the engine "
        "answers this one, as evaluation and rollouts do; 0 or 1 decodes between batches; None: this process's CPU "
        "share less one, at most 8. Unused when everything pending fits one batch.",
    )
    cpus_per_replica: float = Field(1.0, ge=0.0, description="CPUs each engine replica reserves in Ray.")
    decode_cpus: float = Field(1.0, gt=0.0, description="CPUs each media-decoding task reserves in Ray.")
    max_task_retries: int = Field(
        2,
        ge=0,
        description="Times a batch is retried on its restarted replica after the replica died (killed, out of "
        "memory); its items are then recorded as failed, to retry with --retry-failed.",
    )
    max_replica_start_deaths: int = Field(
        3,
        ge=1,
        le=100,
        description="Deaths in a row of engine replicas' processes while building their engines (a segfault, the "
        "OOM killer while the weights load), per replica, after which the next start ends the run with an error: "
        "the pool stops at this times the replicas deaths with no finished start between them; Ray restarts them "
        "until then. A replica that finishes its start resets the count.",
    )
    max_pipeline_restarts: int = Field(
        2,
        ge=0,
        le=100,
        description="Times a Ray Data run starts its pipeline again on the requests not yet written after Ray Data "
        "ended it because a Ray process died (a replica killed while loading its model); the results written are "
        "kept. 0 stops at the first such end, to be resumed by rerunning the command.",
    )
    retry_failed: bool = Field(
        False, description="Run the requests whose earlier result is an error again (the error records are removed)."
    )
    parquet_rows_per_file: int = Field(
        1000, ge=1, description="Parquet output: results per part file (a killed run redoes at most these)."
    )
    parquet_flush_s: float = Field(
        60.0, gt=0.0, le=MAX_SECONDS, description="Parquet output: most seconds a finished result waits before its part file is written."
    )


class Config(Section):
    """The whole recipe; each job reads the sections it needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    vision: VisionConfig = Field(default_factory=VisionConfig)
    generation: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    infer: InferConfig = Field(default_factory=InferConfig)

    # Dotted keys a recipe file, --set or an option named (load_config fills it): generation settings left out
    # take the prompt style's defaults (physreason.chat.style.resolve_sampling); the rest keep the defaults above.
    _explicit_keys: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @property
    def explicit_keys(self) -> frozenset[str]:
        """Dotted keys the recipe, --set or options named; empty for a Config built in code."""
        return self._explicit_keys

    def __eq__(self, other: object) -> bool:
        """Two configs are equal when their settings are; which keys a source named is not a setting."""
        return isinstance(other, Config) and self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]  # mutable, like every pydantic model

    def with_explicit_keys(self, keys: frozenset[str]) -> Config:
        """This config, recording `keys` as the ones its source named (load_config calls it)."""
        self._explicit_keys = frozenset(keys)
        return self

    @property
    def packs_completions(self) -> bool:
        """Whether the GRPO policy update packs each prompt's completions into one row (grpo.pack_completions)."""
        if self.grpo.pack_completions is not None:
            return self.grpo.pack_completions
        return not self.model.attn_implementation.startswith("flash")

    @property
    def policy_temperature(self) -> float:
        """The logit temperature of the GRPO policy: by design the rollout sampling temperature."""
        return self.rollout.sampling_config.temperature

    @property
    def tis_enabled(self) -> bool:
        """Whether GRPO weights its policy loss by truncated importance ratios: grpo.use_tis, else FP8 rollouts."""
        if self.grpo.use_tis is not None:
            return self.grpo.use_tis
        return self.rollout.quantization == "fp8"

    @model_validator(mode="after")
    def _tis_needs_temperature_one(self) -> Config:
        temperature = self.rollout.sampling_config.temperature
        if self.tis_enabled and temperature != 1.0:
            why = "grpo.use_tis = true" if self.grpo.use_tis else "rollout.quantization = 'fp8' turns on grpo.use_tis"
            raise ValueError(
                f"{why}, which compares the engine's temperature-1 log-probs with the policy's, but "
                f"rollout.sampling_config.temperature = {temperature}: set it to 1.0, or grpo.use_tis = false"
            )
        return self

    @field_validator("rollout")
    @classmethod
    def _positive_rollout_temperature(cls, rollout: RolloutConfig) -> RolloutConfig:
        if rollout.sampling_config.temperature <= 0:
            raise ValueError(
                "rollout.sampling_config.temperature must be > 0: GRPO needs sampled completions, "
                "and the policy divides its logits by this same temperature"
            )
        return rollout

    @model_validator(mode="after")
    def _grpo_groups_can_learn(self) -> Config:
        # checked with the recipe, before a GRPO run starts its engine and loads its policy
        if self.rollout.n_generation < 2:
            raise ValueError(
                "rollout.n_generation = 1: GRPO scores each completion against the others of its group, so a group "
                "of one has advantage 0 and nothing is learned; use 2 or more (8 is usual)"
            )
        if self.grpo.overlong_buffer_length > self.rollout.max_response_length:
            raise ValueError(
                f"grpo.overlong_buffer_length ({self.grpo.overlong_buffer_length}) exceeds rollout.max_response_length "
                f"({self.rollout.max_response_length}): the punishment starts that many tokens before the limit"
            )
        return self

    @model_validator(mode="after")
    def _packed_attention_needs_sdpa(self) -> Config:
        if self.grpo.packed_attention == "spans" and self.model.attn_implementation != "sdpa":
            raise ValueError(
                f"grpo.packed_attention = 'spans' replaces sdpa's attention over packed rows, but "
                f"model.attn_implementation = '{self.model.attn_implementation}': use 'sdpa' or grpo.packed_attention = 'mask'"
            )
        return self

    @model_validator(mode="after")
    def _packing_needs_a_mask_kernel(self) -> Config:
        if self.grpo.pack_completions is True and self.model.attn_implementation.startswith("flash"):
            raise ValueError(
                f"grpo.pack_completions needs a 4D attention mask, which model.attn_implementation = "
                f"'{self.model.attn_implementation}' cannot take: use 'sdpa' or 'eager', or grpo.pack_completions = false"
            )
        return self
