"""The Triton paged-attention kernels equal the PyTorch reference: run on CPU through Triton's
interpreter (in a subprocess, since TRITON_INTERPRET must be set before triton is imported), and on
CUDA in bf16 when a GPU is present. The tiled decode/verify kernel is checked over GQA ratios 1, 4
and 8, head_dim 64 and 128, 1..9 new tokens per sequence (mixed in one batch), and contexts that
cross block and split boundaries, and prefill chunks in blocks of new tokens, in float32 and
float16 (bfloat16 on CUDA)."""
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

CHECK = r"""
import torch
from nanospec.kv_cache import KVCache, build_metadata, paged_attention_reference
from nanospec.triton_attention import paged_attention_tiled, paged_attention_tokens

g = torch.Generator().manual_seed(0)

def error(kernel, device, dtype, block_size, heads, kv_heads, dim, seqs, splits=None):
    # seqs: (cached, new) tokens per sequence
    cache = KVCache(1, 80, block_size, kv_heads, dim, dtype, torch.device(device))
    k_cache, v_cache = cache.layer(0)
    tables = [[] for _ in seqs]
    for b, (cached, new) in enumerate(seqs):
        cache.allocator.grow(tables[b], cached + new)
    k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
    meta = build_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], block_size, torch.device(device))
    q = torch.randn(len(meta.positions), heads, dim, generator=g).to(device=device, dtype=dtype)
    ref = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    if kernel == "tokens":
        out = paged_attention_tokens(q, k_cache, v_cache, meta.block_tables, meta.token_seq, meta.positions, dim ** -0.5)
    else:
        out = paged_attention_tiled(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.token_seq,
                                    meta.positions, max(n for _, n in seqs), dim ** -0.5, splits=splits)
    return ((out.float() - ref).norm() / ref.norm()).item()

TOKENS = [(4, 4, 2, 32, [(0, 5), (9, 1), (13, 4)]), (16, 8, 8, 16, [(30, 1), (0, 9), (3, 3)]), (2, 6, 2, 64, [(7, 2)])]
# (block size, heads, kv heads, head_dim, sequences, splits): GQA 1, 4, 8; 1..9 new tokens, mixed in
# a batch; contexts across blocks of 16 and splits (whole tiles of 64 keys: 130 + 9 spans three)
TILED = [(16, 4, 4, 64, [(0, 1), (17, 2), (40, 9)], 1), (16, 8, 2, 128, [(130, 9), (5, 1), (63, 1)], 3),
         (16, 8, 1, 64, [(64, 1), (70, 4), (0, 7)], 2), (4, 8, 1, 128, [(15, 3), (33, 8), (1, 5), (60, 9)], 4),
         (16, 4, 1, 64, [(200, 6), (2, 2)], None), (16, 4, 4, 128, [(i * 11, i + 1) for i in range(9)], 2),
         # prefill chunks: query blocks of 64 // group tokens (more than 128 rows for one program)
         (16, 8, 2, 64, [(0, 40), (17, 33), (5, 1)], 1), (4, 4, 4, 64, [(0, 130), (70, 2)], None),
         (16, 16, 2, 128, [(3, 70)], 2)]

def check(device, dtype, tol):
    for case in TOKENS:
        assert error("tokens", device, dtype, *case) < tol, case
    for case in TILED:
        assert error("tiled", device, dtype, *case) < tol, case
    print("ok")
"""


def test_kernels_equal_the_reference_in_the_interpreter():
    """float32 to 1e-5, and float16 (the half-precision path: 16-bit tl.dot, float32 accumulation)
    to 1e-2. bfloat16 takes the same path but is checked on CUDA only: the interpreter's tl.dot
    multiplies bfloat16's raw bits (a 16 x 16 product comes out 1e10 off; float16 is exact)."""
    code = CHECK + "\ncheck('cpu', torch.float32, 1e-5)\ncheck('cpu', torch.float16, 1e-2)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_wrong_tiled_kernel_fails_the_check():
    """The check's power: the tiled kernel with the causal mask dropped (each new token sees the
    step's later tokens too) is caught."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "nanospec", "triton_attention.py")).read()
    broken = src.replace("(keys[None, :] <= pos[:, None])", "(keys[None, :] <= pos[:, None] + 8)")
    assert broken != src
    code = ("import sys, types, torch\n"
            "import nanospec\n"
            "module = types.ModuleType('nanospec.triton_attention')\n"
            "module.__file__ = '/tmp/nanospec_broken_triton_attention.py'\n"
            f"open(module.__file__, 'w').write({broken!r})\n"
            "exec(compile(open(module.__file__).read(), module.__file__, 'exec'), module.__dict__)\n"
            "sys.modules['nanospec.triton_attention'] = module\n"
            + CHECK + "\nprint(error('tiled', 'cpu', torch.float32, 16, 4, 4, 64, [(20, 5), (3, 9)], 1))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) > 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_equal_the_reference_on_cuda_bf16():
    namespace = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", torch.bfloat16, 1e-2)
