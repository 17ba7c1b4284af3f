"""Paged attention in Triton: K/V are read straight from the pages, never gathered into contiguous
copies. The PyTorch reference (kv_cache.paged_attention_reference) is their oracle; the tests run
the kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1).

Decode and verify steps (a few new tokens per sequence) use the tiled kernel: one program per
(sequence, KV head, context split) takes all group x q_len queries that share the KV head as the
rows of one tile, and walks its split of the context BLOCK_N keys at a time (each key's page looked
up in the block table) with tl.dot, so each KV head is read once per step, not once per query head
and new token. Long contexts at small batches are split across programs (flash-decoding); the
splits' partial results (running max, sum and output, the FlashAttention recurrence) are merged
afterwards. Queries are causal within the new tokens: each sees the keys up to its own position.

Prefill chunks run through the same kernel in blocks of new tokens (a varlen flash kernel: each
program a block of one sequence's tokens x the query heads of one KV head). The first kernel, one
program per (new token, query head) walking its context page by page, stays beside it
(paged_attention_tokens): the GPU check times the two and the reference's SDPA over gathered
pages on a prefill chunk; no GPU has run it yet.
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


if triton is not None:
    @triton.jit
    def _tiled_kernel(q_ptr, k_cache_ptr, v_cache_ptr, acc_ptr, stats_ptr, block_tables_ptr, query_start_ptr,
                      positions_ptr, scale, max_blocks, num_kv_heads, group, split_len,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, TOKENS: tl.constexpr, FP32: tl.constexpr):
        seq, kv_head = tl.program_id(0), tl.program_id(1)
        query_block, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
        start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - start
        rows = tl.arange(0, BLOCK_M)   # row r: new token query_block * TOKENS + r // group, query head r % group
        token, head = query_block * TOKENS + rows // group, kv_head * group + rows % group
        row_ok = (token < q_len) & (rows < TOKENS * group)
        dims = tl.arange(0, HEAD_DIM)
        num_heads = num_kv_heads * group
        q = tl.load(q_ptr + ((start + token) * num_heads + head)[:, None] * HEAD_DIM + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(positions_ptr + start + token, mask=row_ok, other=-1)   # each row sees keys 0 .. pos
        context = tl.max(pos, axis=0) + 1
        lo = split * split_len
        hi = tl.minimum(lo + split_len, context)
        running_max = tl.full((BLOCK_M,), -1.0e30, tl.float32)   # finite: a row with no key here stays at 0
        running_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for first in range(lo, hi, BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            block = tl.load(block_tables_ptr + seq * max_blocks + keys // BLOCK_SIZE, mask=key_ok, other=0)
            offsets = ((block * BLOCK_SIZE + keys % BLOCK_SIZE) * num_kv_heads + kv_head)[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + offsets, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + offsets, mask=key_ok[:, None], other=0.0)
            if FP32:   # exact float32 products (the default would round the inputs to tf32)
                scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale    # [BLOCK_M, BLOCK_N]
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(key_ok[None, :] & (keys[None, :] <= pos[:, None]), scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(weights, axis=1)
            if FP32:
                acc = acc * correction[:, None] + tl.dot(weights, v, input_precision="ieee")
            else:
                acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        # this split's partial result: [seq, kv_head, query block and split, row] -> acc [HEAD_DIM], (max, sum)
        part = ((seq * num_kv_heads + kv_head) * tl.num_programs(2) + tl.program_id(2)) * BLOCK_M + rows
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc)
        tl.store(stats_ptr + part * 2, running_max)
        tl.store(stats_ptr + part * 2 + 1, running_sum)


def num_splits(programs_without: int, max_context: int, block_n: int, programs: int = 132) -> int:
    """Context splits per program: enough programs to fill an H100's 132 SMs once the batch alone
    does not, each split at least 4 tiles of keys long."""
    by_batch = max(1, programs // programs_without)
    by_length = max(1, max_context // (4 * block_n))
    return min(by_batch, by_length, 16)


def paged_attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_start: torch.Tensor, token_seq: torch.Tensor, positions: torch.Tensor, max_q: int,
                          scale: float, splits: int | None = None, block_n: int = 64, max_rows: int = 128) -> torch.Tensor:
    """q: [T, heads, head_dim], sequence b's new tokens at query_start[b] .. query_start[b + 1]
    (at most max_q of them), token t of sequence token_seq[t] at positions[t]; caches:
    [num_blocks, block_size, kv_heads, head_dim]; block_tables: [B, max_blocks].

    A program's rows are `tokens` new tokens x the group of query heads of one KV head: every new
    token of a decode or verify step (up to max_rows rows), or a block of a prefill chunk's tokens.
    splits: context splits per program (default: by num_splits over the tables' width, a bound
    the host knows without a sync)."""
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    batch, max_blocks = block_tables.shape
    group = heads // kv_heads
    tokens = max_q if group * max_q <= max_rows else max(1, 64 // group)
    query_blocks = -(-max_q // tokens)
    block_m = max(16, triton.next_power_of_2(group * tokens))
    splits = splits or num_splits(batch * kv_heads * query_blocks, max_blocks * block_size, block_n)
    split_len = -(-max_blocks * block_size // splits // block_n) * block_n   # whole tiles
    acc = torch.empty(batch, kv_heads, query_blocks, splits, block_m, head_dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch, kv_heads, query_blocks, splits, block_m, 2, dtype=torch.float32, device=q.device)
    _tiled_kernel[(batch, kv_heads, query_blocks * splits)](
        q.contiguous(), k_cache, v_cache, acc, stats, block_tables.contiguous(), query_start, positions, scale,
        max_blocks, kv_heads, group, split_len, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_SPLITS=splits, TOKENS=tokens, FP32=q.dtype == torch.float32)
    # Merge the splits: rescale each split's sum and output to the largest max, then divide.
    top = stats[..., 0].amax(3, keepdim=True)
    weight = torch.exp(stats[..., 0] - top)                                   # [B, kv, blocks, splits, M]
    out = (acc * weight[..., None]).sum(3) / (stats[..., 1] * weight).sum(3)[..., None]   # [B, kv, blocks, M, D]
    # row r of (b, kv_head, query block) is new token block * tokens + r // group, head kv_head * group + r % group
    out = out[..., :group * tokens, :].reshape(batch, kv_heads, query_blocks * tokens, group, head_dim)
    out = out.permute(0, 2, 1, 3, 4).reshape(batch * query_blocks * tokens, heads, head_dim)
    # token t is new token t - query_start[b] of its sequence b (a gather: no data-dependent shape, no sync)
    index = token_seq * (query_blocks * tokens) + torch.arange(num_tokens, device=q.device) - query_start[token_seq]
    return out[index].to(q.dtype)                                            # [T, heads, D], flat order


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """The kernel for a pass (meta: kv_cache.AttentionMetadata): the tiled one, for decode and verify
    steps and for prefill chunks (in blocks of new tokens). Its alternatives for prefill, the
    per-token kernel and the reference's SDPA over gathered pages, are timed beside it by
    `python -m nanospec.bench --gpu-check`; no GPU has run that yet, so the choice is by design
    (tl.dot tiles over one pass of the KV pages), not by measurement."""
    return paged_attention_tiled(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.token_seq,
                                 meta.positions, meta.query_index.shape[1], scale)   # a shape the host knows
