"""The per-token paged-attention kernel, beside the engine's tiled one (nanospec/triton_attention.py) so
that the GPU check can time the two and the reference's SDPA over gathered pages on a prefill chunk:
one program per (new token, query head) walking its context page by page. The engine never launches
it; tests/test_triton_attention.py checks it against the reference in the interpreter, and
tests/test_triton_compile.py compiles it ahead of time for sm_80 and sm_90.

It compiles only for power-of-two head_dim and block size (tl.arange spans the page).
"""
from __future__ import annotations

import torch

from nanospec.triton_attention import triton

if triton is not None:   # CPU-only installs have no Triton: the GPU check times the reference alone
    import triton.language as tl

    from nanospec.triton_attention import _bound

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
        for page in range(0, _bound(pos // BLOCK_SIZE + 1)):
            block = tl.load(block_tables_ptr + seq * max_blocks + page)
            # element (block, slot, kv_head, dim) of the [num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM] pool
            offsets = (((block * BLOCK_SIZE + slots[:, None]) * num_kv_heads + kv_head) * HEAD_DIM
                       + dims[None, :])
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
        tl.store(out_ptr + (token * num_heads + head) * HEAD_DIM + dims,
                 (acc / running_sum).to(out_ptr.dtype.element_ty))


def paged_attention_tokens(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
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
