"""The memory plan of a training job: per-GPU peak bytes by part, from the model's shapes and the recipe, before it runs.

Every formula here is a pure function of integers; units are elements or bytes as each docstring says. The plan
models what physreason's trainers do (build.py, parallelize.py): fp32 master weights, FSDP2 over the data-parallel
ranks (each decoder block, each vision block and the root as units, the root kept gathered between forward and
backward), tensor parallelism of the decoder's linear weights, AdamW with two moments, activation checkpointing
of every block, and the chunked loss. Activation coefficients were measured with saved-tensor hooks on Qwen3-VL's
decoder block (bf16, sdpa, CPU); GPU kernels may save slightly different tensors: bench/memory_plan.py measures
torch.cuda.max_memory_allocated against this plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from physreason.models.sizes import ModelShape, ParamShape
from physreason.train.allocator import HEADROOM_EXPANDABLE, allocator_headroom

GIB = 1024**3
# CUDA context, NCCL buffers and allocator slack: not in any tensor, present on every GPU (an estimate).
RUNTIME_OVERHEAD_BYTES = 2 * GIB
# Share of GPU memory left for the caching allocator's fragmentation with expandable segments (what training processes
# use unless the user sets the allocator; physreason.train.allocator): a plan fits in the rest.
ALLOCATOR_HEADROOM = HEADROOM_EXPANDABLE
# What an "80 GB" H100 reports as its total memory (torch.cuda.get_device_properties), in GiB.
H100_80GB_GIB = 79.2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per token that one decoder block saves for backward in bf16, per unit of each width (measured, see module doc):
# 16 per hidden unit (two RMSNorms' fp32 and bf16 copies, residuals), 10 per query and per key/value unit (q/k norms,
# rotary outputs, attention output), 8 per MLP unit (gate, up, activation, product).
ACT_PER_HIDDEN, ACT_PER_QUERY, ACT_PER_KV, ACT_PER_MLP = 16, 10, 10, 8
# Of these, the fp32 tensors (the RMSNorms and q/k norms compute in fp32) stay the same in an fp32 model: 12 per hidden
# unit, 4 per query and per key/value unit; the rest are param-dtype tensors and scale with it (measured in fp32:
# 20 per hidden unit, 16 per query and key/value unit, 16 per MLP unit).
ACT_FP32_HIDDEN, ACT_FP32_QUERY, ACT_FP32_KV = 12, 4, 4
# The same block compiled (train.compile): inductor's partitioner recomputes the norms, rotary products and the MLP's
# activation in backward, so the block keeps 8 bytes per hidden unit, 6 per query, key/value and MLP unit (bf16,
# measured with saved-tensor hooks on compiled Qwen3-VL blocks on CPU, 2026-11-29: exact over ten widths; Qwen2.5-VL's
# blocks keep less). These scale with the parameter dtype as a whole.
ACT_COMPILED_HIDDEN, ACT_COMPILED_QUERY, ACT_COMPILED_KV, ACT_COMPILED_MLP = 8, 6, 6, 6
# A vision-encoder block, bytes per patch in bf16 per hidden unit and per MLP unit (its queries, keys and values are
# hidden wide), by kind: gated (Qwen2.5-VL: RMSNorm, SwiGLU) or not (Qwen3-VL: LayerNorm, GELU), eager or compiled
# (train.compile_vision). Measured as above over eight widths each (eager within 4%, rounded up; compiled exact). The
# decoder's coefficients had priced Qwen3-VL's blocks at 1.76x what they keep.
VISION_ACT: dict[tuple[bool, bool], tuple[int, int]] = {
    (False, False): (24, 4),
    (False, True): (20, 4),
    (True, False): (32, 8),
    (True, True): (20, 6),
}
# Bytes per [token, vocab] entry at the loss: fp32 log-softmax kept for backward, its fp32 gradient and the logits'.
LOSS_BYTES_PER_LOGIT = 12

Part = Literal[
    "parameters", "gradients", "optimizer state", "gathered weights", "activations", "logits / loss",
    "vision activations", "reference model", "rollout engine", "runtime overhead",
]


@dataclass(frozen=True)
class Layout:
    """How one replica is laid out: processes (one GPU each), TP and CP degrees, and the memory-saving switches."""

    gpus: int
    tp: int = 1
    cp: int = 1  # context parallel: each row's tokens and vision patches split over cp processes
    distributed: bool = True  # FSDP2 under torchrun; False: one plain process holding everything
    lora: bool = False
    cpu_offload: bool = False
    optimizer_state_dtype: str = "float32"
    gradient_checkpointing: bool = True
    mini_batch: int = 1
    checkpoint_every: int = 1  # with checkpointing: decoder blocks 0, n, 2n, ... recomputed, the others keep everything
    vision_checkpoint_every: int = 1  # the same for vision blocks; 0: no vision block recomputed

    @property
    def dp(self) -> int:
        """FSDP2 shard degree: processes / TP degree (context-parallel ranks shard the weights too)."""
        return self.gpus // self.tp if self.distributed else 1


@dataclass(frozen=True)
class Workload:
    """What the recipe asks of each micro-batch and what shares the GPUs, independent of the layout."""

    seq_len: int  # tokens per row (model.model_max_length)
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    loss_chunk_size: int = 0
    vision_tokens: int = 0  # visual tokens per row (SFT) or per prompt (GRPO), worst case (after the 2x2 merge)
    train_vision: bool = True  # vision tower trained (not frozen, or LoRA on it)
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ()
    lora_vision_targets: tuple[str, ...] = ()  # empty: no adapters on the vision blocks
    reference_model: bool = False  # GRPO's frozen KL reference, sharded like the policy
    engine_bytes: int = 0  # a colocated rollout engine's share of each GPU
    # GRPO's policy update (completions_per_prompt > 0): each micro-batch holds mini_batch completions of
    # prompt_tokens + response_tokens, packed (one row per prompt: the prompt once, then its completions) or one row
    # each; the vision tower runs once per distinct prompt of the micro-batch. 0: SFT rows of seq_len, one visual each.
    completions_per_prompt: int = 0
    prompt_tokens: int = 0  # longest prompt, visual tokens included
    response_tokens: int = 0  # rollout.max_response_length
    packed: bool = False  # grpo.pack_completions (sdpa / eager): a [rows, 1, L, L] mask beside every attention
    # packed rows' attention from their spans (sdpa on one context rank: models/packed_attention.py), not the mask
    packed_spans: bool = False
    completions_per_step: int = 0  # train.train_batch_per_replica: a micro-batch holds at most a rank's share of them
    # grpo.mini_batch_tokens: at most this many tokens a forward pass (rows x longest row), a row alone may pass it
    mini_batch_tokens: int = 0
    compiled: bool = False  # train.compile: compiled decoder blocks keep fewer activations (ACT_COMPILED_*)
    compiled_vision: bool = False  # train.compile_vision: the same for vision blocks (VISION_ACT)


@dataclass(frozen=True)
class MicroBatch:
    """What one forward pass of a micro-batch materialises: rows x row_tokens tokens, `visuals` distinct visuals of
    the workload's vision_tokens each, and the tokens whose logits the loss takes (at most `loss_rows` at once)."""

    rows: int
    row_tokens: int
    visuals: int
    loss_rows: int
    packed: bool = False
    per_row: int = 0  # packed: completions a row holds
    prompt: int = 0  # packed: the prompt's tokens in each row
    # the pass's tokens, padding included (at most rows x row_tokens; less where a token budget bounds the pass and
    # shorter completions let more, shorter rows into it); 0: rows x row_tokens
    tokens: int = 0
    completions: int = 0  # packed: the completions the pass holds at most; 0: rows x per_row

    def __post_init__(self) -> None:
        if not self.tokens:
            object.__setattr__(self, "tokens", self.rows * self.row_tokens)
        if not self.completions:
            object.__setattr__(self, "completions", self.rows * self.per_row)


def micro_batch(layout: Layout, workload: Workload) -> MicroBatch:
    """The rows, row length and distinct visuals of one micro-batch of `layout.mini_batch` (see Workload).

    SFT: mini_batch rows of seq_len tokens, one visual each; the loss sees every token (chunked by loss_chunk_size).
    GRPO, m = mini_batch completions (at most this rank's share of completions_per_step) of n = completions_per_prompt
    per prompt (train/policy.py's build_micro_batches): packed, ceil(m / min(n, m)) rows of prompt + min(n, m) completions, one visual each;
    otherwise m rows of prompt + response (at most seq_len), their visuals the distinct prompts among m consecutive
    completions (ceil(m / n), one more when a micro-batch can straddle two groups). The lm_head runs one completion at
    a time (checkpointed), so the loss sees response_tokens rows at once.
    With a token budget B (mini_batch_tokens > 0) build_micro_batches closes a pass when rows x its widest row would
    pass B (a row alone may pass it) and a packed row when its prompt and completions would: a pass then holds at most
    max(B, its longest row) tokens, rows of at most max(B, prompt + response) tokens, and, when completions end early,
    more and shorter rows than full-length ones would give (up to B / (prompt + 1), and up to B / (visual + 1) with a
    visual each where prompts are shorter than the longest; passes no longer aligned with the groups). The plan takes
    those bounds, whatever the completions' and the prompts' lengths.
    """
    m = layout.mini_batch
    n = workload.completions_per_prompt
    if n <= 0:
        return MicroBatch(m, workload.seq_len, m, m * workload.seq_len)
    if workload.completions_per_step:
        data_parallel = max(1, layout.gpus // (layout.tp * layout.cp)) if layout.distributed else 1
        m = max(1, min(m, workload.completions_per_step // data_parallel))
    response = workload.response_tokens or workload.seq_len
    prompt = min(workload.prompt_tokens or workload.seq_len, workload.seq_len)
    budget = workload.mini_batch_tokens
    visual = min(workload.vision_tokens, workload.seq_len)  # one prompt's visual tokens, as the vision part plans them
    if workload.packed:
        per_row = min(n, m)
        row = prompt + per_row * response
        rows = -(-m // per_row)
        if budget <= 0:
            return MicroBatch(rows, row, rows, response, packed=True, per_row=per_row, prompt=prompt)
        row = min(row, max(budget, prompt + response))
        tokens = min(rows * row, max(budget, row))
        rows = min(m, max(1, tokens // (prompt + 1)))  # each row holds its prompt and at least one completion token
        return MicroBatch(rows, row, rows_with_visuals(m, tokens, visual, rows), response, packed=True,
                          per_row=per_row, prompt=prompt, tokens=tokens, completions=min(m, rows * per_row))  # fmt: skip
    row = min(prompt + response, workload.seq_len)
    if budget <= 0:
        visuals = min(m, -(-m // n) + (1 if m % n else 0))
        return MicroBatch(m, row, visuals, response)
    tokens = min(m * row, max(budget, row))
    rows = min(m, max(1, tokens // (prompt + 1)))
    with_visuals = rows_with_visuals(m, tokens, visual, rows)
    visuals = min(with_visuals, (with_visuals - 1) // n + 2)  # passes cut by the budget straddle groups anywhere
    return MicroBatch(rows, row, visuals, response, tokens=tokens)


def rows_with_visuals(m: int, tokens: int, visual: int, rows: int) -> int:
    """Most rows of a budgeted pass of `tokens` that can each bring a visual of `visual` tokens: a row holding one is
    at least visual + 1 tokens long (prompts shorter than the longest, whose length `rows` was counted from, let
    more such rows in); `rows` when there are no visuals."""
    return min(m, max(1, tokens // (visual + 1))) if visual > 0 else rows


@dataclass
class MemoryPlan:
    """Per-GPU peak bytes by part, and the host bytes each process holds for offloaded state."""

    layout: Layout
    parts: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    load_host_bytes: int = 0  # each process loads the whole checkpoint in fp32 on the host before sharding it
    # of "activations", what the backward still holds beside the gradients: with selective recompute
    # (checkpoint_every > 1) the kept blocks' activations are freed block by block as their gradients arrive
    backward_activations: int | None = None
    # gradients that exist while every activation is still held: one plain process's lm_head (the backward's first)
    forward_gradients: int = 0

    @property
    def total(self) -> int:
        """Planned peak bytes on one GPU: the parts that live through the whole step plus the larger of the step's two
        peaks, the end of forward and the end of backward (their parts never coexist in full).

        Whole step: parameters, optimizer state, reference model, rollout engine, runtime overhead, and under FSDP2
        the gathered weights. End of forward: activations, logits / loss, vision activations, and in one plain process
        the gathered weights (there the param-dtype copies the blocks' forwards saved, freed by their backwards) and
        the lm_head's gradient, the backward's first (forward_gradients). End of backward: gradients (zeroed,
        set_to_none, at each step's start and filled by the backward) and the activations when they are checkpointed
        (then small: the block inputs and one block being recomputed; with selective recompute less the kept blocks',
        backward_activations). Measured on one H100 the sum of every part overstated the peak by 20-30%
        (bench/RESULTS.md, ninth session); on Reason2's video row (one H200, one process, 2026-11-29) this total less
        the runtime overhead was within -0.2% and +6.1% of six measured peaks (tests/test_memory_plan.py).
        """
        part = self.parts.get
        whole = sum(part(name, 0) for name in ("parameters", "optimizer state", "reference model", "rollout engine",
                                                "runtime overhead"))  # fmt: skip
        forward = sum(part(name, 0) for name in ("activations", "logits / loss", "vision activations"))
        forward += self.forward_gradients
        held = part("activations", 0) if self.backward_activations is None else self.backward_activations
        backward = part("gradients", 0) + (held if self.layout.gradient_checkpointing else 0)
        if not self.layout.distributed:
            forward += part("gathered weights", 0)
        else:
            whole += part("gathered weights", 0)
        return whole + max(forward, backward)

    def fits(self, gpu_bytes: int) -> bool:
        """True when the planned peak fits `gpu_bytes` less the allocator's headroom (allocator_headroom() of it)."""
        return self.total <= usable_bytes(gpu_bytes)


def usable_bytes(gpu_bytes: int) -> int:
    """Bytes of a GPU a plan may fill: all but the allocator's headroom, ALLOCATOR_HEADROOM with expandable segments
    and more when this process's PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF turns them off (allocator_headroom)."""
    return int(gpu_bytes * (1 - allocator_headroom()))


def shard_numel(shape: tuple[int, ...], dp: int, rank: int = 0) -> int:
    """Elements of `shape` that FSDP2 rank `rank` of `dp` holds: dim 0 cut in chunks of ceil(rows / dp) (torch.chunk).

    The last ranks may hold a shorter chunk or none. A 0-dim tensor counts as one row.
    """
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    chunk = -(-rows // dp)
    return max(0, min(chunk, rows - rank * chunk)) * rest


def tp_shape(param: ParamShape, tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds: column-parallel weights split on dim 0, row-parallel on dim 1, others whole."""
    dims = list(param.shape)
    if tp > 1 and param.tp == "column":
        dims[0] //= tp
    elif tp > 1 and param.tp == "row":
        dims[1] //= tp
    return tuple(dims)


def in_vision_tower(param: ParamShape) -> bool:
    """True for the vision blocks and the tower's patch embedding, position embedding and mergers."""
    return param.unit == "vision" or "visual." in param.name


def lora_params(shape: ModelShape, workload: Workload) -> list[ParamShape]:
    """The adapters PEFT adds: A [rank, in] and B [out, rank] per targeted linear layer, in that block's FSDP2 unit."""
    adapters = []
    for linear in shape.linears:
        targets = workload.lora_targets if linear.unit == "decoder" else workload.lora_vision_targets
        if linear.leaf in targets:
            name = f"{linear.unit}.{linear.block}.{linear.leaf}"
            r = workload.lora_rank
            adapters.append(ParamShape(f"{name}.lora_A", (r, linear.in_features), linear.unit, linear.block, "none"))
            adapters.append(ParamShape(f"{name}.lora_B", (linear.out_features, r), linear.unit, linear.block, "none"))
    return adapters


def trainable(param: ParamShape, layout: Layout, workload: Workload) -> bool:
    """Whether a base parameter trains: none under LoRA, all but the vision tower's when it is frozen."""
    if layout.lora:
        return False
    return workload.train_vision or not in_vision_tower(param)


def activation_bytes_per_token(
    hidden: int, query: int, kv: int, mlp: int, dtype_bytes: int = 2, compiled: bool = False
) -> int:
    """Bytes one decoder block saves for backward per token: the bf16 coefficients, the param-dtype ones scaled to
    dtype_bytes (their fp32 part, ACT_FP32_*, does not scale); compiled: the compiled block's (ACT_COMPILED_*)."""
    if compiled:
        bf16 = ACT_COMPILED_HIDDEN * hidden + ACT_COMPILED_QUERY * query + ACT_COMPILED_KV * kv + ACT_COMPILED_MLP * mlp
        return bf16 * dtype_bytes // 2
    fixed = ACT_FP32_HIDDEN * hidden + ACT_FP32_QUERY * query + ACT_FP32_KV * kv
    scaled = ACT_PER_HIDDEN * hidden + ACT_PER_QUERY * query + ACT_PER_KV * kv + ACT_PER_MLP * mlp - fixed
    return fixed + scaled * dtype_bytes // 2


# Outside its blocks a trained tower keeps, per merged visual token in bf16: the pixel values (2 bytes each) and, per
# unit of the merger's input (vision hidden x merge^2), 12 bytes for Qwen2.5-VL's merger (RMSNorm, GELU MLP), 8 for
# Qwen3-VL's and 6 for each of its deepstack mergers (saved-tensor hooks on the towers, CPU, 2026-11-29).
MERGER_ACT_GATED, MERGER_ACT, DEEPSTACK_MERGER_ACT = 12, 8, 6


def tower_rest_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes a trained vision tower keeps for backward outside its blocks, per merged visual token (see MERGER_ACT)."""
    merged = shape.vision_hidden * shape.vision_merge**2
    per_unit = MERGER_ACT_GATED if shape.vision_gated else MERGER_ACT + DEEPSTACK_MERGER_ACT * shape.vision_deepstack
    return (shape.vision_patch_values * shape.vision_merge**2 * 2 + per_unit * merged) * dtype_bytes // 2


def vision_activation_bytes_per_patch(
    hidden: int, mlp: int, dtype_bytes: int = 2, gated: bool = False, compiled: bool = False
) -> int:
    """Bytes one vision-encoder block saves for backward per patch (VISION_ACT), scaled to dtype_bytes."""
    per_hidden, per_mlp = VISION_ACT[(gated, compiled)]
    return (per_hidden * hidden + per_mlp * mlp) * dtype_bytes // 2


def checkpointed_blocks(blocks: int, every: int) -> int:
    """How many of `blocks` are recomputed when blocks 0, every, 2 x every, ... are (every 0: none)."""
    return -(-blocks // every) if every > 0 else 0


def stack_activation_bytes(
    tokens: int, blocks: int, per_token: int, hidden: int, dtype_bytes: int, checkpointed: bool, every: int = 1
) -> int:
    """Peak activation bytes of a stack of blocks in backward.

    Checkpointed (every n-th block from the first, n = `every`): each recomputed block keeps its input
    (tokens x hidden x dtype_bytes), the others their full activations (tokens x per_token each), plus one block
    recomputed in full. Not checkpointed (or every 0): every block keeps its full activations.
    """
    recomputed = checkpointed_blocks(blocks, every) if checkpointed else 0
    if recomputed == 0:
        return blocks * tokens * per_token
    return recomputed * tokens * hidden * dtype_bytes + (blocks - recomputed + 1) * tokens * per_token


def loss_bytes(tokens: int, vocab: int, chunk: int) -> int:
    """Peak bytes of the lm_head + cross-entropy: [rows, vocab] x LOSS_BYTES_PER_LOGIT, rows = min(tokens, chunk)."""
    rows = min(tokens, chunk) if chunk > 0 else tokens
    return rows * vocab * LOSS_BYTES_PER_LOGIT


def plan_memory(shape: ModelShape, layout: Layout, workload: Workload, rank: int = 0) -> MemoryPlan:
    """Per-GPU peak memory of one training step of `shape` laid out as `layout` doing `workload` on data-parallel rank
    `rank` (0, the default, holds the largest shards).

    Sharded state (bytes, each parameter p sharded as shard_numel(tp_shape(p), dp)):
      parameters = sum over all p of local(p) x 4 (fp32 masters, frozen ones too)
      gradients = sum over trained p of local(p) x 4
      optimizer state = sum over trained p of local(p) x 2 moments x (4 fp32 | 2 bf16)
    With cpu_offload these live in host memory (host_bytes), not on the GPU.
    gathered weights (FSDP2): the root unit stays gathered from forward to backward (root x param bytes, plus its
      trained gradients unsharded in param dtype through backward), and two blocks are gathered at a time (the
      current and the prefetched, block x param bytes) with one block's unsharded gradient (x reduce bytes).
      One plain process instead keeps param-dtype copies of the trained weights (autocast).
    activations: stack_activation_bytes of the decoder for the micro-batch's rows x row_tokens / cp tokens
      (micro_batch: mini_batch x seq_len for SFT; GRPO's completions as its policy update lays them out), plus, for
      packed GRPO rows, the [rows, 1, L, L] attention mask (bool) and its param-dtype copy that each attention keeps,
      or, where the attention runs from the rows' spans, the mask and what each attention keeps beyond a plain row's:
      the prompt's keys and values once per completion and the prompt's output, the completions' keys, values and
      queries gathered and their output (query heads each);
      logits / loss: loss_bytes; vision activations: the same for visuals x vision_tokens x merge^2 / cp patches when
      the tower trains, one block's worth when frozen. Under context parallelism every rank also keeps the
      embeddings of the whole rows (rows x row_tokens x hidden in param dtype), from which it takes its slice.
    """
    tp, dp = layout.tp, layout.dp
    param_bytes = DTYPE_BYTES[workload.param_dtype]
    reduce_bytes = DTYPE_BYTES[workload.reduce_dtype]
    state_bytes = DTYPE_BYTES[layout.optimizer_state_dtype]
    base = [(p, trainable(p, layout, workload)) for p in shape.params]
    adapters = [(p, True) for p in lora_params(shape, workload)] if layout.lora else []
    everything = base + adapters

    def local(p: ParamShape) -> int:
        return shard_numel(tp_shape(p, tp), dp, rank) if layout.distributed else p.numel

    params = sum(local(p) for p, _ in everything) * 4
    grads = sum(local(p) for p, trains in everything if trains) * 4
    optimizer = sum(local(p) for p, trains in everything if trains) * 2 * state_bytes
    plan = MemoryPlan(layout, load_host_bytes=sum(p.numel for p, _ in everything) * 4)
    reference = params if workload.reference_model else 0
    if layout.cpu_offload:
        plan.host_bytes = params + grads + optimizer + reference
        params = grads = optimizer = reference = 0
    plan.parts.update({"parameters": params, "gradients": grads, "optimizer state": optimizer})
    if not layout.distributed and not layout.cpu_offload:  # FSDP2: in the root's unsharded gradient (gathered weights)
        heads = [p for p, trains in everything if trains and p.unit == "root" and "lm_head" in p.name]
        heads = heads or [p for p, trains in everything if trains and p.unit == "root" and "embed_tokens" in p.name]
        plan.forward_gradients = sum(local(p) for p in heads) * 4

    if layout.distributed:
        blocks: dict[tuple[str, int], list[int]] = {}
        root = root_trained = 0
        for p, trains in everything:
            numel = math.prod(tp_shape(p, tp)) if p.shape else 1
            if p.unit == "root":
                root += numel
                root_trained += numel if trains else 0
            else:
                entry = blocks.setdefault((p.unit, p.block), [0, 0])
                entry[0] += numel
                entry[1] += numel if trains else 0
        biggest = max((b[0] for b in blocks.values()), default=0)
        biggest_trained = max((b[1] for b in blocks.values()), default=0)
        gathered = (root + 2 * biggest) * param_bytes + root_trained * param_bytes + biggest_trained * reduce_bytes
    else:
        gathered = sum(p.numel for p, trains in everything if trains) * param_bytes if param_bytes < 4 else 0
    plan.parts["gathered weights"] = gathered

    batch = micro_batch(layout, workload)
    tokens = -(-batch.tokens // layout.cp)  # this rank's slice of its rows
    per_token = activation_bytes_per_token(
        shape.hidden, shape.heads * shape.head_dim // tp, shape.kv_heads * shape.head_dim // tp,
        shape.intermediate // tp, param_bytes, workload.compiled,
    )
    plan.parts["activations"] = stack_activation_bytes(
        tokens, shape.layers, per_token, shape.hidden, param_bytes, layout.gradient_checkpointing,
        layout.checkpoint_every,
    )  # fmt: skip
    kept = plan.parts["activations"] - stack_activation_bytes(
        tokens, shape.layers, per_token, shape.hidden, param_bytes, layout.gradient_checkpointing
    )  # what the blocks that are not recomputed keep beyond the inputs every recomputed block would keep
    if layout.cp > 1:
        plan.parts["activations"] += batch.tokens * shape.hidden * param_bytes
    if batch.packed:
        # [rows, 1, L, L] entries (under context parallelism every rank holds the whole rows' mask: Ulysses attends
        # over all L for its heads), L padded to a multiple of cp; the sum of the rows' L x L is at most the pass's
        # tokens x its longest row
        mask = batch.tokens * -(-batch.row_tokens // layout.cp) * layout.cp
        recomputed = checkpointed_blocks(shape.layers, layout.checkpoint_every) if layout.gradient_checkpointing else 0
        held = shape.layers - recomputed + 1 if recomputed else shape.layers  # blocks whose attention state is held
        if workload.packed_spans:
            # flash's variable-length call keeps its packed queries and output (H heads, the row's tokens), keys and
            # values (H_kv heads: the prompt once for itself and once per completion, then the completions) and the
            # float32 log-sum-exp of every query head
            # keys and values: every row's tokens, and its prompt once more for each of its completions
            keys = batch.tokens + batch.completions * batch.prompt
            entries = (2 * batch.tokens * shape.heads + 2 * keys * shape.kv_heads) * shape.head_dim
            lse = batch.tokens * shape.heads * 4
            plan.parts["activations"] += mask + held * (entries * param_bytes + lse) // tp
        else:
            plan.parts["activations"] += mask + held * mask * param_bytes
    if layout.gradient_checkpointing and kept > 0:
        plan.backward_activations = plan.parts["activations"] - kept
    plan.parts["logits / loss"] = loss_bytes(min(tokens, batch.loss_rows), shape.vocab, workload.loss_chunk_size)
    vision = 0
    if shape.vision_depth and workload.vision_tokens:
        patches = batch.visuals * min(workload.vision_tokens, workload.seq_len) * shape.vision_merge**2
        patches = -(-patches // layout.cp)  # each context-parallel rank encodes its share of the temporal patches
        per_patch = vision_activation_bytes_per_patch(
            shape.vision_hidden, shape.vision_intermediate, param_bytes, shape.vision_gated, workload.compiled_vision
        )
        tower_trains = (workload.train_vision and not layout.lora) or (layout.lora and bool(workload.lora_vision_targets))
        if tower_trains:
            vision = stack_activation_bytes(
                patches, shape.vision_depth, per_patch, shape.vision_hidden, param_bytes, layout.gradient_checkpointing,
                layout.vision_checkpoint_every,
            )  # fmt: skip
            vision += -(-patches // shape.vision_merge**2) * tower_rest_bytes_per_token(shape, param_bytes)
        else:
            vision = patches * per_patch  # nothing is saved for backward; one block's working set at a time
    plan.parts["vision activations"] = vision
    plan.parts["reference model"] = reference
    plan.parts["rollout engine"] = workload.engine_bytes
    plan.parts["runtime overhead"] = RUNTIME_OVERHEAD_BYTES
    return plan


# What tensor parallelism cost where it was measured (bench/RESULTS.md, issue 47): the 3B shape, SFT, 4,096-token rows.
TP_MEASURED = "at the 3B shape tp 2 ran at 0.57x the tokens/s of dp 2 (2 x H100) and tp 2 x dp 2 at 0.46x of dp 4 (4 x H200)"


def tp_degrees(shape: ModelShape, gpus: int) -> list[int]:
    """TP degrees possible on `gpus` processes: divisors of gpus (at most 8, one node) that divide both head counts."""
    return [t for t in range(1, min(gpus, 8) + 1) if gpus % t == 0 and shape.heads % t == 0 and shape.kv_heads % t == 0]


def cp_degrees(shape: ModelShape, gpus: int, tp: int) -> list[int]:
    """Context-parallel degrees possible with TP degree tp on `gpus` processes: divisors of gpus / tp that divide the
    query heads each TP rank holds (Ulysses splits them)."""
    rest, heads = gpus // tp, shape.heads // tp
    return [c for c in range(1, rest + 1) if rest % c == 0 and heads % c == 0]


def candidate_layouts(shape: ModelShape, recipe: Layout) -> list[Layout]:
    """Every layout on the recipe's GPU count: TP and CP degrees, LoRA, offload, optimizer state dtype, checkpointing
    and micro-batch (the recipe's and each smaller power of two), in order of preference (closest to the recipe first)."""
    micro = sorted({recipe.mini_batch, *[2**k for k in range(8) if 2**k < recipe.mini_batch]}, reverse=True)
    # with checkpointing: the recipe's share of blocks recomputed, and every block (the most memory it can save)
    asked = (recipe.checkpoint_every, recipe.vision_checkpoint_every)
    recompute = [(False, asked), *[(True, every) for every in dict.fromkeys([asked, (1, 1)])]]
    layouts = []
    for tp, cp in [(t, c) for t in tp_degrees(shape, recipe.gpus) for c in cp_degrees(shape, recipe.gpus, t)]:
        for lora in sorted({recipe.lora, True}):
            for offload in (False, True):
                for state in ("float32", "bfloat16"):
                    for checkpointing, every in recompute:
                        for mini in micro:
                            distributed = recipe.gpus > 1 or offload or recipe.distributed
                            if tp > 1 and (lora or not distributed):
                                continue  # LoRA is not tensor-parallel here; TP needs torchrun
                            if cp > 1 and not distributed:
                                continue  # context parallelism needs torchrun
                            layouts.append(replace(
                                recipe, tp=tp, cp=cp, distributed=distributed, lora=lora, cpu_offload=offload,
                                optimizer_state_dtype=state, gradient_checkpointing=checkpointing, mini_batch=mini,
                                checkpoint_every=every[0], vision_checkpoint_every=every[1],
                            ))

    def preference(layout: Layout) -> tuple:
        return (
            # a CP degree other than the recipe's changes no numbers but costs all-to-alls: before bf16 AdamW state
            layout.lora != recipe.lora, layout.cpu_offload, abs(layout.cp - recipe.cp),
            layout.optimizer_state_dtype != "float32", layout.tp,
            # recomputing every block again (the recipe's speed lever undone) before anything above changes
            (layout.checkpoint_every, layout.vision_checkpoint_every) != asked,
            layout.gradient_checkpointing, -layout.mini_batch,
        )

    return sorted(layouts, key=preference)


def fsdp_alone_fits(plans: list[MemoryPlan], layout: Layout) -> bool:
    """Whether one of `plans` (layouts that fit) needs no tensor parallelism for what `layout` trains: TP 1 with the
    same full or LoRA training and the same CPU offload."""
    return any(
        plan.layout.tp == 1 and plan.layout.lora == layout.lora and plan.layout.cpu_offload == layout.cpu_offload
        for plan in plans
    )


def fitting_layouts(shape: ModelShape, recipe: Layout, workload: Workload, gpu_bytes: int) -> list[MemoryPlan]:
    """Plans of the candidate layouts that fit `gpu_bytes`, most preferred first.

    A tensor-parallel layout only where FSDP alone cannot fit without more CPU offload or LoRA (fsdp_alone_fits): TP
    shares each batch over its ranks and all-reduces activations in every block, which costs throughput at the shapes
    measured (TP_MEASURED).
    """
    plans = (plan_memory(shape, layout, workload) for layout in candidate_layouts(shape, recipe))
    fitting = [plan for plan in plans if plan.fits(gpu_bytes)]
    return [plan for plan in fitting if plan.layout.tp == 1 or not fsdp_alone_fits(fitting, plan.layout)]


def layout_overrides(recipe: Layout, layout: Layout, mini_batch_key: str = "train.mini_batch") -> list[str]:
    """The --set overrides that turn the recipe's layout into `layout` (and the launch change, if any)."""
    changes = []
    if layout.tp != recipe.tp:
        changes.append(f"policy.parallelism.tp_size={layout.tp}")
    if layout.cp != recipe.cp:
        changes.append(f"policy.parallelism.cp_size={layout.cp}")
    if layout.lora != recipe.lora:
        changes.append(f"train.lora.enable={str(layout.lora).lower()}")
    if layout.cpu_offload != recipe.cpu_offload:
        changes.append(f"train.cpu_offload={str(layout.cpu_offload).lower()}")
    if layout.optimizer_state_dtype != recipe.optimizer_state_dtype:
        changes.append(f"train.optimizer_state_dtype='{layout.optimizer_state_dtype}'")
    if layout.gradient_checkpointing != recipe.gradient_checkpointing:
        changes.append(f"train.gradient_checkpointing={str(layout.gradient_checkpointing).lower()}")
    if layout.checkpoint_every != recipe.checkpoint_every:
        changes.append(f"train.checkpoint_every={layout.checkpoint_every}")
    if layout.vision_checkpoint_every != recipe.vision_checkpoint_every:
        changes.append(f"train.vision_checkpoint_every={layout.vision_checkpoint_every}")
    if layout.mini_batch != recipe.mini_batch:
        changes.append(f"{mini_batch_key}={layout.mini_batch}")
    return changes
