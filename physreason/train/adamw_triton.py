"""The Triton kernel of physreason.train.adamw's grouped update (imported there at first use, so Triton is needed only
where a GPU update runs): one program per (tensor, chunk) pair of the tables `adamw._Tables` builds."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block(p_ptr, g_ptr, m_ptr, v_ptr, offs, numel, lr, beta1, beta2, eps, decay, bias1, bias2_sqrt,
           MASKED: tl.constexpr):  # fmt: skip
    # adamw_bf16_update, operation for operation, on BLOCK elements
    if MASKED:
        mask = offs < numel
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    denom = tl.sqrt_rn(v) / bias2_sqrt + eps
    p = p * (1 - lr * decay) - (lr / bias1) * m / denom
    if MASKED:
        tl.store(m_ptr + offs, m.to(tl.bfloat16), mask=mask)
        tl.store(v_ptr + offs, v.to(tl.bfloat16), mask=mask)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(m_ptr + offs, m.to(tl.bfloat16))
        tl.store(v_ptr + offs, v.to(tl.bfloat16))
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty))


@triton.jit
def adamw_bf16_grouped_kernel(pointers, chunks, lr, beta1, beta2, eps, decay, bias1, bias2_sqrt,
                              PARAM_BF16: tl.constexpr, GRAD_BF16: tl.constexpr, ALIGNED: tl.constexpr,
                              BLOCK: tl.constexpr, ITERS: tl.constexpr):  # fmt: skip
    program = tl.program_id(0)
    row = tl.load(chunks + 2 * program).to(tl.int64)
    chunk = tl.load(chunks + 2 * program + 1).to(tl.int64)
    entry = pointers + 5 * row
    if PARAM_BF16:
        p_ptr = tl.load(entry).to(tl.pointer_type(tl.bfloat16))
    else:
        p_ptr = tl.load(entry).to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        g_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(entry + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(entry + 2).to(tl.pointer_type(tl.bfloat16))
    v_ptr = tl.load(entry + 3).to(tl.pointer_type(tl.bfloat16))
    numel = tl.load(entry + 4)
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    start = chunk * (BLOCK * ITERS)
    block = tl.arange(0, BLOCK)
    if start + BLOCK * ITERS <= numel:
        for i in range(ITERS):
            _block(p_ptr, g_ptr, m_ptr, v_ptr, start + i * BLOCK + block, numel, lr, beta1, beta2, eps, decay,
                   bias1, bias2_sqrt, False)  # fmt: skip
    else:
        for i in range(ITERS):
            _block(p_ptr, g_ptr, m_ptr, v_ptr, start + i * BLOCK + block, numel, lr, beta1, beta2, eps, decay,
                   bias1, bias2_sqrt, True)  # fmt: skip
