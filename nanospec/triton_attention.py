"""Paged attention as one Triton kernel: K/V are read straight from the pages, never gathered into
contiguous copies. The PyTorch reference (kv_cache.paged_attention_reference) is its oracle; the
tests run this kernel on CPU through Triton's interpreter (TRITON_INTERPRET=1).

One program handles one (new token, query head): it walks the token's sequence page by page up to
the token's own position (causal, also within a multi-token verify step) with an online softmax,
the running max and sum rescaled as each page arrives (the FlashAttention recurrence).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the reference path is used
    triton = None


def available(q: torch.Tensor) -> bool:
    return triton is not None and q.is_cuda


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, token_seq_ptr,
                                positions_ptr, scale, max_blocks, num_kv_heads, group,
                                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        token, head = tl.program_id(0), tl.program_id(1)
        kv_head = head // group
        seq = tl.load(token_seq_ptr + token)
        pos = tl.load(positions_ptr + token)                  # sees keys 0 .. pos
        dims = tl.arange(0, HEAD_DIM)
        slots = tl.arange(0, BLOCK_SIZE)
        num_heads = num_kv_heads * group
        q = tl.load(q_ptr + (token * num_heads + head) * HEAD_DIM + dims).to(tl.float32) * scale
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        for page in range(0, pos // BLOCK_SIZE + 1):
            block = tl.load(block_tables_ptr + seq * max_blocks + page)
            # element (block, slot, kv_head, dim) of the [num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM] pool
            offsets = ((block * BLOCK_SIZE + slots[:, None]) * num_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + offsets).to(tl.float32)   # [BLOCK_SIZE, HEAD_DIM]
            v = tl.load(v_cache_ptr + offsets).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1)                # [BLOCK_SIZE]
            scores = tl.where(page * BLOCK_SIZE + slots <= pos, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max)
            running_sum = running_sum * correction + tl.sum(weights, axis=0)
            acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
            running_max = new_max
        tl.store(out_ptr + (token * num_heads + head) * HEAD_DIM + dims, (acc / running_sum).to(out_ptr.dtype.element_ty))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, token_seq: torch.Tensor, positions: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]; block_tables:
    [B, max_blocks]; token_seq, positions: [T] (each new token's sequence and position)."""
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    _paged_attention_kernel[(tokens, heads)](
        q.contiguous(), k_cache, v_cache, out, block_tables.contiguous(), token_seq, positions, scale,
        block_tables.shape[1], kv_heads, heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
    return out
