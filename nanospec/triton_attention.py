"""Paged attention in Triton: K/V are read straight from the pages, never gathered into contiguous
copies. The PyTorch reference (kv_cache.paged_attention_reference) is their oracle; the tests run
the kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1), and compile every variant the
engine launches ahead of time for sm_80 and sm_90 (no spills).

Decode and verify steps (a few new tokens per sequence) use the tiled kernel: one program per
(sequence, KV head, context split) takes all group x q_len queries that share the KV head as the
rows of one tile, and walks its split of the context BLOCK_N keys at a time (each key's page looked
up in the block table) with tl.dot, so each KV head is read once per step, not once per query head
and new token. Queries are causal within the new tokens: each sees the keys up to its own position.

Long contexts at small batches are split across programs (flash-decoding). The host fixes only a
bound on the splits (the grid, from shapes: under CUDA graphs the block table is the full width
whatever the context); each sequence picks its own count from its real context inside the kernel,
and the programs past it exit at once. A sequence of one split writes its finished rows straight
into the output; one of several writes partial results (running max, sum and output, the
FlashAttention recurrence) that one small merge kernel combines into the output rows.

Prefill chunks run through the same kernel in blocks of new tokens (a varlen flash kernel: each
program a block of one sequence's tokens x the query heads of one KV head). The first kernel, one
program per (new token, query head), lives in benchmarks/per_token_attention.py: the GPU check times
the two and the reference's SDPA over gathered pages on a prefill chunk.

Before attending, one more kernel does the rest of a layer's attention input: rotate_and_store
rotates the new queries and keys (RoPE; Qwen3's per-head q/k RMSNorm first) and stores the keys
and values in their slots of the pages, one launch where eager PyTorch took three to six, its
rotation rounding as the model's eager one does.

The kernels compile only for power-of-two head_dim (16 .. 128) and block size (tl.arange spans
powers of two): `available` says False otherwise, and the model uses the reference.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the reference path is used
    triton = None


TREE_NODES = 63   # the nodes a draft tree's mask holds: the bits of an int64, its sign bit left clear


def available(q: torch.Tensor, k_cache: torch.Tensor, meta=None) -> bool:
    """Whether the Triton kernels run this attention: triton installed, q [T, heads, head_dim] on
    CUDA, and shapes they compile for, k_cache [num_blocks, block_size, kv_heads, head_dim] giving
    the block size. tl.arange spans a power of two (head_dim; the tiled kernel's page arithmetic is
    compiled for one), tl.dot needs 16 or more along head_dim, and tiles past head_dim 128 are neither
    compiled by the tests nor sized to fit. A draft tree's mask (meta.tree) is a bitmask of TREE_NODES
    nodes a token."""
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    powers_of_two = all(n > 0 and n & (n - 1) == 0 for n in (head_dim, block_size))
    tree_fits = meta is None or meta.tree is None or meta.tree[1].shape[2] <= TREE_NODES
    return triton is not None and q.is_cuda and 16 <= head_dim <= 128 and powers_of_two and tree_fits


if triton is not None:
    # Triton 3.6's interpreter takes a loop bound with int(array of shape (1,)) (every scalar there is
    # such an array, a kernel argument as much as a loaded value), which NumPy 2.4 refuses: "only
    # 0-dimensional arrays can be converted to Python scalars" (triton-lang/triton#9171; 3.9 squeezes
    # first). So the kernels pass their runtime loop bounds through _bound.
    _INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret if hasattr(triton, "knobs")
                                else os.environ.get("TRITON_INTERPRET") == "1")   # older Triton: no knobs

    @triton.jit
    def _bound(x):
        """A runtime loop bound as `range` takes it: unchanged when compiled (the compiler never sees
        the constexpr-false branch), a Python int under the interpreter."""
        if _INTERPRETED:
            return x.handle.data.item()   # returned: the interpreter would make an assigned int an array
        return x

    _TREE_NODES = tl.constexpr(TREE_NODES)

    @triton.jit
    def _rows(query_block, kv_head, group, tokens, q_len, BLOCK_M: tl.constexpr):
        """A program's rows (rows, token, head, row_ok): row r is new token query_block * tokens + r // group
        of its sequence and query head kv_head * group + r % group; row_ok is False past the sequence's
        q_len new tokens and on the padding rows past tokens * group."""
        rows = tl.arange(0, BLOCK_M)
        token = query_block * tokens + rows // group
        return rows, token, kv_head * group + rows % group, (token < q_len) & (rows < tokens * group)

    @triton.jit
    def _split_plan(query_start_ptr, positions_ptr, seq, max_splits, BLOCK_N: tl.constexpr):
        """Sequence seq's context splits, (count, keys per split), from its real context: one split
        per 4 tiles of BLOCK_N keys, at most max_splits, each a whole number of tiles, and no split
        empty. The tiled kernel and the merge both call this, so they agree on the count."""
        end = tl.load(query_start_ptr + seq + 1)
        context = tl.load(positions_ptr + end - 1) + 1   # the last new token sees the most keys
        tiles = tl.cdiv(context, BLOCK_N)
        per_split = tl.cdiv(tiles, tl.minimum(tl.maximum(tiles // 4, 1), max_splits))
        return tl.cdiv(tiles, per_split), per_split * BLOCK_N

    @triton.jit
    def _store_rows(out_ptr, start, token, head, num_heads, row_ok, values, HEAD_DIM: tl.constexpr):
        """values [BLOCK_M, HEAD_DIM] into out [T, heads, HEAD_DIM] (its dtype): row r at flat token
        start + token[r], head head[r]."""
        offsets = ((start + token) * num_heads + head)[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _visible(keys, key_ok, pos, tree_ptr, seq, at, row_ok, TREE: tl.constexpr):
        """[rows, keys]: the keys (key_ok: real) each row sees, 0 .. its position; of a draft tree's
        nodes (the keys from its sequence's base, tree_ptr[seq], on: at or below each row's own slot)
        only those whose bit is set in the row's bits (tree_ptr past the bases, at its token `at`)."""
        visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if TREE:
            node = keys - tl.load(tree_ptr + seq)
            in_tree = (node >= 0) & (node < _TREE_NODES)
            bits = tl.load(tree_ptr + tl.num_programs(0) + at, mask=row_ok, other=0)
            seen = ((bits[:, None] >> tl.where(in_tree, node, 0)[None, :]) & 1) != 0
            visible = tl.where(in_tree[None, :], seen & key_ok[None, :], visible)
        return visible

    @triton.jit
    def _dot(a, b, FP32: tl.constexpr):
        """a @ b, in exact float32 products where FP32 (the default would round the inputs to tf32)."""
        if FP32:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _load_keys(k_cache_ptr, v_cache_ptr, table_ptr, keys, key_ok, num_kv_heads, kv_head, dims,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """The K and V [BLOCK_N, HEAD_DIM] of one KV head at the sequence's positions `keys`, through
        its block table (0 where not key_ok)."""
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
        offsets = (((block * BLOCK_SIZE + keys % BLOCK_SIZE) * num_kv_heads + kv_head)[:, None] * HEAD_DIM
                   + dims[None, :])
        return (tl.load(k_cache_ptr + offsets, mask=key_ok[:, None], other=0.0),
                tl.load(v_cache_ptr + offsets, mask=key_ok[:, None], other=0.0))

    @triton.jit
    def _store_partial(part_stats_ptr, part_acc_ptr, part, rows, row_ok, running_max, running_sum, acc, dims,
                       BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A split's partial result for _merge_kernel: part [B, kv_heads, query blocks, splits] -> its
        (max, sum) rows and its acc rows."""
        tl.store(part_stats_ptr + part * 2 * BLOCK_M + rows, running_max, mask=row_ok)
        tl.store(part_stats_ptr + (part * 2 + 1) * BLOCK_M + rows, running_sum, mask=row_ok)
        tl.store(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None])

    # Runtime ints are not specialized (Triton would compile another variant wherever one of them is
    # 1 or a multiple of 16): the variants are the constexpr sets of tiled_constexprs and
    # merge_constexprs, and the ahead-of-time test compiles exactly those.
    @triton.jit(do_not_specialize=["max_blocks", "num_kv_heads", "group", "tokens", "max_splits"])
    def _tiled_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_stats_ptr,
                      block_tables_ptr, query_start_ptr, positions_ptr, tree_ptr, scale, max_blocks,
                      num_kv_heads, group, tokens, max_splits, BLOCK_SIZE: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DIRECT: tl.constexpr, FP32: tl.constexpr, TREE: tl.constexpr):
        """One program per (sequence, KV head, query block x split of the bound max_splits): its
        rows' attention over its split of the context. DIRECT: the bound is 1, so there is no split
        to choose and no partial result. TREE: a draft tree's mask (kv_cache.AttentionMetadata.tree),
        tree_ptr [B + T]: each sequence's base, then each token's bits (_visible)."""
        seq, kv_head = tl.program_id(0), tl.program_id(1)
        query_block, split = tl.program_id(2) // max_splits, tl.program_id(2) % max_splits
        start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - start
        if query_block * tokens >= q_len:   # the grid covers the longest sequence's new tokens
            return
        if DIRECT:   # a launch of one split: the whole context, output written here
            num_splits, split_len = 1, 0
        else:
            num_splits, split_len = _split_plan(query_start_ptr, positions_ptr, seq, max_splits, BLOCK_N)
            if split >= num_splits:   # this sequence's context needs fewer splits than the grid has
                return
        rows, token, head, row_ok = _rows(query_block, kv_head, group, tokens, q_len, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        num_heads = num_kv_heads * group
        q = tl.load(q_ptr + ((start + token) * num_heads + head)[:, None] * HEAD_DIM + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(positions_ptr + start + token, mask=row_ok, other=-1)   # each row sees keys 0 .. pos
        hi = tl.max(pos, axis=0) + 1
        if DIRECT:
            lo = 0
        else:   # this split's keys (none where this block of tokens sees fewer keys than its sequence)
            lo = split * split_len
            hi = tl.minimum(lo + split_len, hi)
        # the recurrence's running max (finite: a row with no key here stays at 0), sum and output
        running_max, running_sum = tl.full((BLOCK_M,), -1.0e30, tl.float32), tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for first in range(_bound(lo), _bound(hi), BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            k, v = _load_keys(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * max_blocks, keys, key_ok,
                              num_kv_heads, kv_head, dims, BLOCK_SIZE, HEAD_DIM)
            scores = tl.where(_visible(keys, key_ok, pos, tree_ptr, seq, start + token, row_ok, TREE),
                              _dot(q, tl.trans(k), FP32) * scale, float("-inf"))   # [BLOCK_M, BLOCK_N]
            # the FlashAttention recurrence: rescale what came before to the new running max
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + _dot(weights.to(v.dtype), v, FP32)
            running_max = new_max
        if num_splits == 1:   # the whole context: the finished rows, straight into the output
            _store_rows(out_ptr, start, token, head, num_heads, row_ok, acc / running_sum[:, None], HEAD_DIM)
        else:   # a partial result for _merge_kernel
            part = (seq * num_kv_heads + kv_head) * tl.num_programs(2) + tl.program_id(2)
            _store_partial(part_stats_ptr, part_acc_ptr, part, rows, row_ok, running_max, running_sum, acc,
                           dims, BLOCK_M, HEAD_DIM)

    @triton.jit(do_not_specialize=["num_kv_heads", "group", "tokens", "max_splits"])
    def _merge_kernel(out_ptr, part_acc_ptr, part_stats_ptr, query_start_ptr, positions_ptr, num_kv_heads,
                      group, tokens, max_splits, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """One program per (sequence, KV head, query block) of the tiled kernel's grid: its real splits'
        partial results rescaled to their largest max and summed, then divided, into the output rows."""
        seq, kv_head, query_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - start
        if query_block * tokens >= q_len:
            return
        num_splits, _ = _split_plan(query_start_ptr, positions_ptr, seq, max_splits, BLOCK_N)
        if num_splits == 1:   # the tiled kernel wrote these rows itself
            return
        rows, token, head, row_ok = _rows(query_block, kv_head, group, tokens, q_len, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        top = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        first = ((seq * num_kv_heads + kv_head) * tl.num_programs(2) + query_block) * max_splits
        for part in range(_bound(first), _bound(first + num_splits)):
            part_max = tl.load(part_stats_ptr + part * 2 * BLOCK_M + rows, mask=row_ok, other=-1.0e30)
            part_sum = tl.load(part_stats_ptr + (part * 2 + 1) * BLOCK_M + rows, mask=row_ok, other=0.0)
            part_acc = tl.load(part_acc_ptr + (part * BLOCK_M + rows)[:, None] * HEAD_DIM + dims[None, :],
                               mask=row_ok[:, None], other=0.0)
            # the same recurrence over splits: both sides rescaled to the larger max
            new_top = tl.maximum(top, part_max)
            old_scale, part_scale = tl.exp(top - new_top), tl.exp(part_max - new_top)
            total = total * old_scale + part_sum * part_scale
            acc = acc * old_scale[:, None] + part_acc * part_scale[:, None]
            top = new_top
        _store_rows(out_ptr, start, token, head, num_kv_heads * group, row_ok, acc / total[:, None], HEAD_DIM)

    @triton.jit
    def _norm_times(weight, normed, dtype):
        """rms_norm's last step, rounded as it is: weight * normed.to(dtype), in dtype; as float32."""
        return (weight.to(tl.float32) * normed.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)

    @triton.jit
    def _rotate_store_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                             q_norm_ptr, k_norm_ptr, eps, qk_token_stride, qk_head_stride, qk_dim_stride,
                             v_token_stride, v_head_stride, v_dim_stride, table_stride, cache_slot_stride,
                             heads, kv_heads, HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
        """One head of one new token: a query head rotated into q_out [T, heads, HEAD_DIM], a key
        head rotated into its cache slot, or a value head copied into its slot (program_id(1): the
        query heads, then the key heads, then the value heads). The rotation is the model's
        rotate() (x * cos + swap(x) * sin in float32, swap exchanging the halves), launched with
        fused multiply-adds off so that it rounds as the eager ops do: bit for bit. NORM: first each
        query and key head's RMSNorm (Qwen3's q_norm, k_norm), as model.rms_norm rounds it (its mean
        summed in another order: not bit for bit)."""
        token, head = tl.program_id(0), tl.program_id(1)
        dims = tl.arange(0, HEAD_DIM)
        slot = tl.load(slots_ptr + token)   # the new token's slot in the pages (for a key or value head)
        if head < heads + kv_heads:
            row = qk_ptr + token * qk_token_stride + head * qk_head_stride
            partner = (dims + HEAD_DIM // 2) % HEAD_DIM   # swap's source: the other half
            x = tl.load(row + dims * qk_dim_stride).to(tl.float32)
            swapped = tl.load(row + partner * qk_dim_stride).to(tl.float32)
            if NORM:
                if head < heads:
                    weight, weight_swapped = tl.load(q_norm_ptr + dims), tl.load(q_norm_ptr + partner)
                else:
                    weight, weight_swapped = tl.load(k_norm_ptr + dims), tl.load(k_norm_ptr + partner)
                inverse = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
                x = _norm_times(weight, x * inverse, q_out_ptr.dtype.element_ty)
                swapped = _norm_times(weight_swapped, swapped * inverse, q_out_ptr.dtype.element_ty)
            cos = tl.load(cos_ptr + token * table_stride + dims)
            sin = tl.load(sin_ptr + token * table_stride + dims)
            rotated = x * cos + swapped * sin
            if head < heads:
                tl.store(q_out_ptr + (token * heads + head) * HEAD_DIM + dims,
                         rotated.to(q_out_ptr.dtype.element_ty))
            else:
                tl.store(k_cache_ptr + slot * cache_slot_stride + (head - heads) * HEAD_DIM + dims,
                         rotated.to(k_cache_ptr.dtype.element_ty))
        else:
            v_head = head - heads - kv_heads
            value = tl.load(v_ptr + token * v_token_stride + v_head * v_head_stride + dims * v_dim_stride)
            tl.store(v_cache_ptr + slot * cache_slot_stride + v_head * HEAD_DIM + dims, value)


MAX_SPLITS = 16   # most context splits of one (sequence, KV head, query block)


@dataclass(frozen=True)
class Tile:
    """How the tiled kernel covers a pass: a program's rows are `tokens` new tokens x the group of
    query heads of one KV head, padded to block_m (a power of two, at least 16 for tl.dot); it walks
    the context block_n keys at a time. The merge takes the same rows, with as many warps."""
    tokens: int
    block_m: int
    block_n: int
    num_warps: int


def tile_config(max_q: int, group: int, head_dim: int, dtype: torch.dtype) -> Tile:
    """The tile for a pass whose sequences add at most max_q new tokens each: all of them in one
    program where the rows fit (a decode or verify step: each KV head read once), else blocks of
    tokens (a prefill chunk). A pure function of host-known shapes, so the grid is the same under
    CUDA graphs, and the ahead-of-time test compiles what it returns (tests/test_triton_compile.py).

    Sized so that no tile spills registers on sm_80 or sm_90 (measured by that test): 8 warps from
    8,192 elements of the [rows, head_dim] accumulator on, and 32 keys a step past that; float32's
    exact products run on FMA units, not tensor cores, so its tiles are 16 x 16."""
    if dtype == torch.float32:
        step_rows, chunk_rows, block_n = 16, 16, 16
    else:
        step_rows, chunk_rows, block_n = 128, 64, 64
    tokens = max_q if group * max_q <= step_rows else max(1, chunk_rows // group)
    block_m = max(16, 1 << (group * tokens - 1).bit_length())   # a power of two, 16 or more for tl.dot
    elements = block_m * head_dim
    warps = 8 if elements >= 8192 else 4
    return Tile(tokens, block_m, block_n if elements <= 8192 else 32, warps)


def tiled_constexprs(tile: Tile, head_dim: int, block_size: int, dtype: torch.dtype, direct: bool,
                     tree: bool = False) -> dict:
    """The tiled kernel's compile-time arguments (one variant each)."""
    return dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                DIRECT=direct, FP32=dtype == torch.float32, TREE=tree)


def merge_constexprs(tile: Tile, head_dim: int) -> dict:
    return dict(HEAD_DIM=head_dim, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n)


def split_bound(programs: int, max_keys: int, block_n: int, sm_count: int) -> int:
    """The grid's context splits per (sequence, KV head, query block), from host-known shapes only:
    enough programs to fill the SMs once the batch alone does not (programs: the grid without
    splits), no more than a table max_keys wide holds at 4 tiles a split, at most MAX_SPLITS. Only
    a bound: each sequence picks its own count from its real context in the kernel (_split_plan),
    since under CUDA graphs the table is the full width whatever the context."""
    return max(1, min(sm_count // programs, max_keys // (4 * block_n), MAX_SPLITS))


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H100's 132 elsewhere (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def paged_attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start: torch.Tensor, positions: torch.Tensor,
                          max_q: int, scale: float, splits: int | None = None,
                          tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim], sequence b's new tokens at query_start[b] .. query_start[b + 1]
    (at most max_q of them), token t at positions[t]; caches: [num_blocks, block_size, kv_heads,
    head_dim]; block_tables: [B, max_blocks]. Returns [T, heads, head_dim] in q's dtype.

    splits: the bound on context splits (default: split_bound). With one, every program writes its
    rows of the output; with more, a sequence that uses several writes partial results that
    _merge_kernel combines into the output. tree: a draft tree's (base [B], bits [T] int64): token t
    sees node j (the key at base + j, j < TREE_NODES) only where bit j of bits[t] is set (sent as one
    buffer [B + T], base then bits)."""
    q = q.contiguous()
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    batch, max_blocks = block_tables.shape
    group = heads // kv_heads
    tile = tile_config(max_q, group, head_dim, q.dtype)
    query_blocks = -(-max_q // tile.tokens)
    splits = splits or split_bound(batch * kv_heads * query_blocks, max_blocks * block_size, tile.block_n,
                                   sm_count(q.device))
    out = torch.empty_like(q)
    parts = batch * kv_heads * query_blocks * splits if splits > 1 else 0   # partial results, one per program
    part_acc = torch.empty(parts, tile.block_m, head_dim, dtype=torch.float32, device=q.device)
    part_stats = torch.empty(parts, 2, tile.block_m, dtype=torch.float32, device=q.device)   # (max, sum)
    _tiled_kernel[(batch, kv_heads, query_blocks * splits)](
        q, k_cache, v_cache, out, part_acc, part_stats, block_tables.contiguous(), query_start, positions,
        positions if tree is None else torch.cat(tree), scale, max_blocks, kv_heads, group, tile.tokens,
        splits,
        **tiled_constexprs(tile, head_dim, block_size, q.dtype, direct=splits == 1, tree=tree is not None),
        num_warps=tile.num_warps)
    if splits > 1:
        _merge_kernel[(batch, kv_heads, query_blocks)](
            out, part_acc, part_stats, query_start, positions, kv_heads, group, tile.tokens, splits,
            **merge_constexprs(tile, head_dim), num_warps=tile.num_warps)
    return out


ROTATE_STORE_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}   # a head: 16-128 elements; see the kernel


def rotate_and_store(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     eps: float = 0.0) -> torch.Tensor:
    """What Attention does before attending, in one launch (in place of a rotation and two index
    writes, and for Qwen3 two norms and a cat): qk [T, heads + kv_heads,
    head_dim] rotated with the pass's tables cos, sin [T, 1, head_dim] (RotaryEmbedding.tables,
    float32), its key heads and v [T, kv_heads, head_dim] stored in their slots of the caches
    [num_blocks, block_size, kv_heads, head_dim].
    Returns the rotated queries [T, heads, head_dim], contiguous as the attention kernel reads them.
    qk and v may be any strided views of the qkv product (row views of it on a GPU; on a CPU, under
    the interpreter, cpu_linear.Linear's few-row product is a transposed view); the reference is
    RotaryEmbedding.rotate then kv_cache.write_kv. q_norm, k_norm [head_dim] (with eps): each query
    and key head RMSNorm'd first, as Qwen3 does (model.rms_norm)."""
    tokens, both, head_dim = qk.shape
    kv_heads = v.shape[1]
    heads = both - kv_heads
    q = torch.empty(tokens, heads, head_dim, dtype=qk.dtype, device=qk.device)
    _rotate_store_kernel[(tokens, heads + 2 * kv_heads)](
        qk, v, cos, sin, slot_mapping, q, k_cache, v_cache, q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q, eps, *qk.stride(), *v.stride(), cos.stride(0), k_cache.stride(1),
        heads, kv_heads, HEAD_DIM=head_dim, NORM=q_norm is not None, **ROTATE_STORE_OPTIONS)
    return q


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                    scale: float) -> torch.Tensor:
    """The kernel for a pass (meta: kv_cache.AttentionMetadata; the kernels need no attention mask,
    so none is built on this path; a draft tree's goes as a bitmask a token): the tiled one, for decode
    and verify steps and for prefill chunks (in blocks of new tokens). Its alternatives for prefill, the
    per-token kernel and the reference's SDPA over gathered pages, are timed beside it by `python -m
    benchmarks.gpu_check`."""
    tree = None if meta.tree is None else meta.once("bits", lambda: tree_bits(meta))   # (per pass)
    return paged_attention_tiled(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.positions,
                                 meta.query_index.shape[1], scale, tree=tree)   # max_q: known on the host


def tree_bits(meta) -> tuple[torch.Tensor, torch.Tensor]:
    """meta.tree as the kernel reads it: (base [B], bits [T]), bit j of a token's bits set where it sees
    node j (at most TREE_NODES nodes: `available`)."""
    base, visible = meta.tree   # visible [B, max_q, R]
    powers = 1 << torch.arange(visible.shape[2], device=visible.device)   # int64: 2 ** j
    bits = (visible.long() * powers).sum(-1)   # [B, max_q]
    row = meta.token_seq
    offset = torch.arange(len(row), device=row.device) - meta.query_start[row]
    return base.contiguous(), bits[row, offset].contiguous()
