"""The fused Triton paged-attention kernel equals the PyTorch reference: run on CPU through Triton's
interpreter (in a subprocess, since TRITON_INTERPRET must be set before triton is imported), and on
CUDA in bf16 when a GPU is present."""
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

CHECK = r"""
import torch
from nanospec.kv_cache import KVCache, build_metadata, paged_attention_reference, write_kv
from nanospec.triton_attention import paged_attention_triton

def check(device, dtype, tol):
    g = torch.Generator().manual_seed(0)
    for block_size, heads, kv_heads, dim, seqs in [(4, 4, 2, 32, [(0, 5), (9, 1), (13, 4)]),
                                                  (16, 8, 8, 16, [(30, 1), (0, 9), (3, 3)]),
                                                  (2, 6, 2, 64, [(7, 2)])]:
        cache = KVCache(1, 64, block_size, kv_heads, dim, dtype, torch.device(device))
        k_cache, v_cache = cache.layer(0)
        tables = [[] for _ in seqs]
        for b, (cached, new) in enumerate(seqs):
            cache.allocator.grow(tables[b], cached + new)
        k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
        meta = build_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], block_size, torch.device(device))
        positions = torch.cat([torch.arange(c, c + n) for c, n in seqs]).to(device)
        q = torch.randn(len(positions), heads, dim, generator=g).to(device=device, dtype=dtype)
        ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
        out = paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.token_seq, positions, dim ** -0.5)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < tol, (block_size, heads, kv_heads, dim, err)
    print("ok")
"""


def test_kernel_equals_reference_in_interpreter():
    code = CHECK + "\ncheck('cpu', torch.float32, 1e-5)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_equals_reference_on_cuda_bf16():
    namespace = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", torch.bfloat16, 1e-2)
