"""Paged attention equals contiguous attention, and the allocator never loses or shares a block."""
import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec import kv_cache, kv_mirror
from nanospec.kv_cache import (BlockAllocator, KVCache, OutOfBlocks, build_metadata,
                               paged_attention_reference, write_kv)


def contiguous_attention(q, k, v, start: int) -> torch.Tensor:
    """Plain causal attention in float64 for one sequence: q [n, H, D] at positions start..,
    k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@settings(max_examples=40, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]),
       seqs=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([1, 2, 3, 9])), min_size=1, max_size=5),
       seed=st.integers(0, 2**16), split=st.sampled_from([1, 8, 10**9]), mirror=st.booleans())
def test_paged_attention_equals_contiguous(block_size, seqs, seed, split, mirror):
    """seqs: (cached tokens, new query tokens) per sequence; blocks are handed out interleaved. split:
    the rows' runs made at that RUN_SPLIT (1: a run per row; 10**9: the batch as one); the reference
    attention or the CPU's mirror."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 8
    # 5 sequences of 49 at block size 1
    cache = KVCache(1, 5 * 49, block_size, kv_heads, dim, torch.float32, torch.device("cpu"))
    k_cache, v_cache = cache.layer(0)
    tables = [[] for _ in seqs]
    full_k, full_v = [], []
    for b, (cached, new) in enumerate(seqs):        # write the cached part through the pages
        cache.allocator.grow(tables[b], cached + new)
        full_k.append(torch.randn(cached + new, kv_heads, dim, generator=g))
        full_v.append(torch.randn(cached + new, kv_heads, dim, generator=g))
        if cached:
            meta = build_metadata([tables[b]], [0], [cached], block_size, torch.device("cpu"))
            write_kv(k_cache, v_cache, full_k[b][:cached], full_v[b][:cached], meta.slot_mapping)
    meta = build_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], block_size, torch.device("cpu"))
    new_k, new_v = (torch.cat([x[c:] for x, (c, _) in zip(full, seqs)]) for full in (full_k, full_v))
    q = torch.randn(sum(n for _, n in seqs), heads, dim, generator=g)
    with unittest.mock.patch.object(kv_cache, "RUN_SPLIT", split):
        meta.runs = kv_cache.query_runs([n for _, n in seqs])
    if mirror:   # the CPU's
        out = kv_mirror.paged_attention(q, new_k, new_v, cache, 0, meta, scale=dim ** -0.5)
        assert cache.mirror is not None
    else:
        write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
        out = paged_attention_reference(q, cache.layer(0), meta, scale=dim ** -0.5)
    start = 0
    for b, (cached, new) in enumerate(seqs):
        expected = contiguous_attention(q[start:start + new], full_k[b], full_v[b], cached)
        assert torch.allclose(out[start:start + new].double(), expected, atol=1e-5)
        start += new


def test_decode_rows_beside_a_prefill_chunk_attend_apart():
    """query_runs: rows padded together only while the padding stays under RUN_SPLIT queries."""
    assert kv_cache.query_runs([1] * 16 + [32]) == [(0, 16, 1), (16, 17, 32)]   # a mixed step
    assert kv_cache.query_runs([5, 1, 3, 5] * 4) == [(0, 16, 5)]   # dynamic K: a few queries apart
    assert kv_cache.query_runs([1, 1, 40, 40, 1]) == [(0, 2, 1), (2, 5, 40)]   # 2 * 39 padded split; 39 not


def test_allocator_grows_truncates_and_releases():
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    a, b = [], []
    alloc.grow(a, 9)             # 3 blocks
    alloc.grow(b, 4)             # 1 block
    assert len(a) == 3 and len(b) == 1 and alloc.num_free == 2 and not set(a) & set(b)
    alloc.truncate(a, 5)         # roll back to 5 tokens: 2 blocks stay, the third is freed
    assert len(a) == 2 and alloc.num_free == 3
    with pytest.raises(OutOfBlocks):
        alloc.grow(b, 4 * 5)
    assert len(b) == 1           # a failed grow takes nothing
    alloc.release(a)
    alloc.release(b)
    assert sorted(alloc.free_blocks) == list(range(6))


def metadata_on_the_host(block_tables, num_cached, query_lens, block_size):
    """The attention metadata written out on the host, slot by slot (what build_metadata derives on
    the device): the oracle."""
    slots, positions, token_seq = [], [], []
    for b, (table, start, n) in enumerate(zip(block_tables, num_cached, query_lens)):
        for p in range(start, start + n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            positions.append(p)
            token_seq.append(b)
    max_blocks, max_q = max(map(len, block_tables)), max(query_lens)
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)
    valid = [[i < n for i in range(max_q)] for n in query_lens]
    return {"slot_mapping": slots, "positions": positions, "token_seq": token_seq, "query_start": query_start,
            "context_lens": [c + n for c, n in zip(num_cached, query_lens)],
            "block_tables": [t + [0] * (max_blocks - len(t)) for t in block_tables],
            "query_valid": valid,
            "query_index": [[query_start[b] + i if valid[b][i] else 0 for i in range(max_q)]
                            for b in range(len(valid))],
            # a real query's row (padding rows are never read)
            "attention_mask": [[k <= c + i for k in range(max_blocks * block_size)]
                               for c, n in zip(num_cached, query_lens) for i in range(n)]}


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]),
       seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9), st.integers(0, 2)), min_size=1,
                     max_size=6),
       extra=st.lists(st.integers(-5, 10**6), max_size=5), seed=st.integers(0, 2**16))
def test_metadata_derived_on_the_device_equals_the_host_oracle(block_size, seqs, extra, seed):
    """seqs: (cached tokens, new tokens, spare blocks past them) per sequence; block ids shuffled."""
    rng = __import__("random").Random(seed)
    need = [-(-(c + n) // block_size) + spare for c, n, spare in seqs]
    ids = rng.sample(range(1000), sum(need))
    tables = [ids[sum(need[:b]):sum(need[:b + 1])] for b in range(len(seqs))]
    cached, lens = [c for c, _, _ in seqs], [n for _, n, _ in seqs]
    meta = build_metadata(tables, cached, lens, block_size, torch.device("cpu"), extra=extra)
    expected = metadata_on_the_host(tables, cached, lens, block_size)
    assert meta.attention_mask(block_size)[:, 0][meta.query_valid].tolist() == expected.pop("attention_mask")
    for name, value in expected.items():
        assert getattr(meta, name).tolist() == value, name
    assert meta.extra.tolist() == extra


def test_metadata_is_one_copy_from_the_host(monkeypatch):
    """All build_metadata takes from the host goes in one tensor (one host-to-device copy)."""
    made, real = [], torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: (made.append(a), real(*a, **kw))[1])
    build_metadata([[3, 4], [7]], [5, 0], [2, 3], 4, torch.device("cpu"), extra=[1, 2, 3])
    assert len(made) == 1
