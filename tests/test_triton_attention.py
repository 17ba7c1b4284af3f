"""The Triton paged-attention kernels equal the PyTorch reference: run on CPU through Triton's
interpreter (in a subprocess, since TRITON_INTERPRET must be set before triton is imported), and on
CUDA in bf16 when a GPU is present. The tiled decode/verify kernel is checked over GQA ratios 1, 4
and 8, head_dim 64 and 128, 1..9 new tokens per sequence (mixed in one batch), contexts that cross
block and split boundaries, and prefill chunks in blocks of new tokens, in float32 and float16
(bfloat16 on CUDA); both of its ways out: one split writing the output rows itself, and several
(chosen per sequence inside the kernel, under a bound from the grid) combined by the merge kernel,
in one batch, also over block tables far wider than the contexts (as under CUDA graphs). Broken
copies of the kernels (no causal mask; a merge without the max rescale) fail the same check."""
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import torch
from nanospec.kv_cache import KVCache, build_metadata, paged_attention_reference
from benchmarks.per_token_attention import paged_attention_tokens
from nanospec.triton_attention import paged_attention_tiled

g = torch.Generator().manual_seed(0)

def error(kernel, device, dtype, block_size, heads, kv_heads, dim, seqs, splits=None, width=0):
    # seqs: (cached, new) tokens per sequence; width: block-table columns, the tables padded with the
    # null block 0 to it as under CUDA graphs (0: as wide as the longest sequence needs)
    cache = KVCache(1, 160, block_size, kv_heads, dim, dtype, torch.device(device))
    k_cache, v_cache = cache.layer(0)
    tables = [[] for _ in seqs]
    for b, (cached, new) in enumerate(seqs):
        cache.allocator.grow(tables[b], cached + new)
    tables = [t + [0] * (width - len(t)) for t in tables]
    k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
    meta = build_metadata(tables, [c for c, _ in seqs], [n for _, n in seqs], block_size,
                          torch.device(device))
    q = torch.randn(len(meta.positions), heads, dim, generator=g).to(device=device, dtype=dtype)
    ref = paged_attention_reference(q.float(), cache.layer(0).float(), meta, dim ** -0.5)
    if kernel == "tokens":
        out = paged_attention_tokens(q, k_cache, v_cache, meta.block_tables, meta.token_seq, meta.positions,
                                     dim ** -0.5)
    else:
        out = paged_attention_tiled(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.positions,
                                    max(n for _, n in seqs), dim ** -0.5, splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    return ((out.float() - ref).norm() / ref.norm()).item()

TOKENS = [(4, 4, 2, 32, [(0, 5), (9, 1), (13, 4)]), (16, 8, 8, 16, [(30, 1), (0, 9), (3, 3)]),
          (2, 6, 2, 64, [(7, 2)])]
# (block size, heads, kv heads, head_dim, sequences, split bound, table width). A sequence's splits
# are whole tiles of 64 keys (16 in float32), one per 4 tiles of its context, at most the bound.
TILED = [
    # one split (the bound 1): rows written straight into the output; GQA 1, 4, 8; 1..9 new tokens
    (16, 4, 4, 64, [(0, 1), (17, 2), (40, 9)], 1, 0), (16, 8, 1, 64, [(64, 1), (70, 4), (0, 7)], 1, 0),
    (16, 4, 4, 128, [(i * 11, i + 1) for i in range(9)], 1, 0),
    # several splits, chosen in the kernel: long sequences beside short ones of one split, and a
    # bound above what any context here uses
    (16, 8, 2, 128, [(520, 9), (5, 1), (63, 1)], 3, 0),
    (4, 8, 1, 128, [(300, 3), (33, 8), (1, 5), (260, 9)], 16, 0),
    (16, 8, 8, 64, [(700, 2), (90, 1)], 16, 0),
    # tables far wider than the contexts, as under CUDA graphs: the default bound from the grid and
    # the width (9 to 16 here), each sequence splitting by its own context
    (16, 4, 1, 64, [(600, 6), (2, 2), (150, 1)], None, 150), (16, 32, 8, 128, [(900, 1)], None, 150),
    # prefill chunks: blocks of 64 // group tokens (16 // group in float32), with and without splits;
    # the chunk's first blocks see fewer keys than its sequence's later splits start at
    (16, 8, 2, 64, [(0, 40), (17, 33), (5, 1)], 1, 0), (4, 4, 4, 64, [(0, 130), (70, 2)], None, 0),
    (16, 16, 2, 128, [(600, 40)], 4, 0), (16, 8, 2, 64, [(200, 330)], 4, 0),
]

def tree_error(device, dtype, block_size, heads, kv_heads, dim, seqs, splits=None):
    # seqs: (context, earlier nodes, new nodes) per sequence: a draft tree's nodes sit from the
    # context on, the earlier ones cached (a drafter's frontier) and the new ones this pass's queries;
    # a random tree over them, each query seeing its node's ancestors and itself
    from nanospec.triton_attention import tree_bits
    cache = KVCache(1, 160, block_size, kv_heads, dim, dtype, torch.device(device))
    k_cache, v_cache = cache.layer(0)
    tables = [[] for _ in seqs]
    for b, (context, earlier, new) in enumerate(seqs):
        cache.allocator.grow(tables[b], context + earlier + new)
    k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(dtype))
    v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(dtype))
    meta = build_metadata(tables, [c + e for c, e, _ in seqs], [n for _, _, n in seqs], block_size,
                          torch.device(device))
    region, most = max(e + n for _, e, n in seqs), max(n for _, _, n in seqs)
    visible = torch.zeros(len(seqs), most, region, dtype=torch.bool)
    for b, (_, earlier, new) in enumerate(seqs):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, earlier + new)]
        for i in range(new):
            node = earlier + i
            while node >= 0:
                visible[b, i, node] = True
                node = parents[node]
    meta.tree = torch.tensor([c for c, _, _ in seqs], device=device), visible.to(device)
    q = torch.randn(len(meta.positions), heads, dim, generator=g).to(device=device, dtype=dtype)
    ref = paged_attention_reference(q.float(), cache.layer(0).float(), meta, dim ** -0.5)
    out = paged_attention_tiled(q, k_cache, v_cache, meta.block_tables, meta.query_start, meta.positions,
                                most, dim ** -0.5, splits=splits, tree=tree_bits(meta))
    return ((out.float() - ref).norm() / ref.norm()).item()

# (block size, heads, kv heads, head_dim, (context, earlier nodes, new nodes) per sequence, split bound):
# a verify step's trees (no earlier nodes), a drafter's frontier (earlier nodes, one query), across
# blocks and splits
TREES = [(16, 4, 4, 64, [(20, 0, 5), (3, 0, 9), (40, 0, 1)], 1),
         (4, 8, 2, 64, [(17, 0, 7), (0, 0, 4)], 16),
         (16, 8, 1, 64, [(33, 6, 1), (15, 3, 1), (70, 9, 1)], 1),
         (16, 4, 2, 128, [(600, 0, 9), (5, 4, 1)], 4),
         (16, 4, 2, 64, [(30, 0, 45), (5, 40, 1)], 1)]   # a tree's nodes past bit 31 of the mask

def check(device, dtype, tol):
    for case in TOKENS:
        assert error("tokens", device, dtype, *case) < tol, case
    for case in TILED:
        assert error("tiled", device, dtype, *case) < tol, case
    for case in TREES:
        assert tree_error(device, dtype, *case) < tol, case
    print("ok")
"""


# rotate_and_store against the model's rotation and write_kv, bit for bit: the rotated queries and
# the whole pages (so a wrong slot or head shows), qk as the qkv product's row view (Llama on a
# GPU), contiguous (Qwen3's normed heads) or a column-major view (cpu_linear.Linear's few rows on a CPU).
ROTATE_CHECK = r"""
import torch
from nanospec.kv_cache import write_kv
from nanospec.model import RotaryEmbedding, rms_norm_eager
from nanospec.triton_attention import rotate_and_store

g = torch.Generator().manual_seed(1)

def inputs(device, dtype, heads, kv_heads, dim, tokens, layout):
    # qk and v as views of one qkv product, rotary tables, pages and distinct slots
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(device=device, dtype=dtype) * 3
    if layout == "transposed":   # cpu_linear.Linear's few-row product on a CPU: a column-major view
        qkv = qkv.T.contiguous().T
    qk = qkv[:, :(heads + kv_heads) * dim].unflatten(1, (heads + kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim:].unflatten(1, (kv_heads, dim))
    if layout == "contiguous":
        qk = qk.contiguous()
    angles = torch.randn(tokens, dim // 2, generator=g, dtype=torch.float64) * 100
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].float().to(device)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)[:, None].float().to(device)
    pages = torch.randn(2, 9, 4, kv_heads, dim, generator=g).to(device=device, dtype=dtype)
    return qk, v, cos, sin, pages, torch.randperm(32, generator=g)[:tokens].to(device)

def expected_of(qk, v, cos, sin, pages, slots, heads):
    # the reference: rotate, then write_kv into a copy of the pages; (rotated queries, pages)
    expected = pages.clone()
    rotated = RotaryEmbedding.rotate.eager(qk, cos, sin)
    write_kv(expected[0], expected[1], rotated[:, heads:], v, slots)
    return rotated[:, :heads], expected

def mismatches(device, dtype, heads, kv_heads, dim, tokens, layout):
    qk, v, cos, sin, pages, slots = inputs(device, dtype, heads, kv_heads, dim, tokens, layout)
    expected_q, expected_pages = expected_of(qk, v, cos, sin, pages, slots, heads)
    q = rotate_and_store(qk, v, cos, sin, pages[0], pages[1], slots)
    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    return (q != expected_q).sum().item() + (pages != expected_pages).sum().item()

def norm_error(device, dtype, heads, kv_heads, dim, tokens, layout):
    # with Qwen3's q/k norms: the largest relative error of q and the pages against rms_norm, then
    # rotate and write_kv (the norm's mean is summed in another order: close, not bit for bit)
    qk, v, cos, sin, pages, slots = inputs(device, dtype, heads, kv_heads, dim, tokens, layout)
    q_norm, k_norm = (1 + 0.3 * torch.randn(2, dim, generator=g)).to(device=device, dtype=dtype)
    normed = torch.cat([rms_norm_eager(qk[:, :heads], q_norm, 1e-6),
                        rms_norm_eager(qk[:, heads:], k_norm, 1e-6)], 1)
    expected_q, expected_pages = expected_of(normed, v, cos, sin, pages, slots, heads)
    q = rotate_and_store(qk, v, cos, sin, pages[0], pages[1], slots, q_norm, k_norm, 1e-6)
    written = slice(None), slots // 4, slots % 4   # the new tokens' slots only (mismatches checks the rest)
    return max(((a.double() - b.double()).norm() / b.double().norm()).item()
               for a, b in ((q, expected_q), (pages[written], expected_pages[written])))

CASES = [(4, 2, 32, 5, "rows"), (8, 2, 64, 3, "contiguous"), (32, 8, 128, 7, "rows"), (16, 16, 64, 1, "rows"),
         (4, 2, 32, 2, "transposed"), (8, 2, 16, 6, "transposed")]

def check_rotate(device, dtypes):
    for dtype in dtypes:
        for case in CASES:
            assert mismatches(device, dtype, *case) == 0, (dtype, case)
            error = norm_error(device, dtype, *case)
            bound = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
            assert error < bound, (dtype, case, error)
    print("ok")
"""


def run_check(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with TRITON_INTERPRET=1 (set before triton is imported), at the
    repository root (the per-token kernel lives in benchmarks/)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT)


@pytest.mark.slow
def test_kernels_equal_the_reference_in_the_interpreter_float32():
    proc = run_check(CHECK + "\ncheck('cpu', torch.float32, 1e-5)\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow
def test_kernels_equal_the_reference_in_the_interpreter_float16():
    """The half-precision path (16-bit tl.dot, float32 accumulation) to 1e-2. bfloat16 takes the
    same path but is checked on CUDA only: the interpreter's tl.dot multiplies bfloat16's raw bits
    (a 16 x 16 product comes out 1e10 off; float16 is exact)."""
    proc = run_check(CHECK + "\ncheck('cpu', torch.float16, 1e-2)\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def broken_error(tmp_path, old: str, new: str, case: str, check: str = CHECK, call: str = "error") -> float:
    """call(case) of a check (the attention error by default) with the module's source changed
    from `old` to `new`."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "nanospec", "triton_attention.py")).read()
    broken = src.replace(old, new)
    assert broken != src
    path = str(tmp_path / "broken_triton_attention.py")   # the interpreter reads a kernel's source from here
    with open(path, "w") as f:
        f.write(broken)
    code = ("import sys, types, torch\n"
            "import nanospec\n"
            "module = types.ModuleType('nanospec.triton_attention')\n"
            f"module.__file__ = {path!r}\n"
            "exec(compile(open(module.__file__).read(), module.__file__, 'exec'), module.__dict__)\n"
            "sys.modules['nanospec.triton_attention'] = module\n"
            + check + f"\nprint({call}({case}))\n")
    proc = run_check(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_wrong_tiled_kernel_fails_the_check(tmp_path):
    """The check's power: the tiled kernel with the causal mask dropped (each new token sees the
    step's later tokens too) is caught."""
    error = broken_error(tmp_path, "(keys[None, :] <= pos[:, None])", "(keys[None, :] <= pos[:, None] + 8)",
                         "'tiled', 'cpu', torch.float32, 16, 4, 4, 64, [(20, 5), (3, 9)], 1")
    assert error > 1e-2


@pytest.mark.slow
def test_a_tiled_kernel_without_the_tree_mask_fails_the_check(tmp_path):
    """A draft tree's mask dropped (each node sees every earlier node, not its ancestors only) is caught."""
    error = broken_error(tmp_path, "visible = tl.where(in_tree[None, :], seen & key_ok[None, :], visible)",
                         "visible = visible",
                         "'cpu', torch.float32, 16, 4, 4, 64, [(20, 0, 7), (3, 5, 1)], 1", call="tree_error")
    assert error > 1e-2


@pytest.mark.slow
def test_a_wrong_merge_fails_the_check(tmp_path):
    """The merge's power: splits summed without rescaling each to the largest max are caught."""
    error = broken_error(tmp_path, "tl.exp(top - new_top), tl.exp(part_max - new_top)",
                         "tl.exp(top - top), tl.exp(part_max - part_max)",
                         "'tiled', 'cpu', torch.float32, 16, 4, 2, 64, [(300, 3), (40, 1)], 8")
    assert error > 1e-2


@pytest.mark.slow
def test_rotate_and_store_is_the_rotation_and_writes_bit_for_bit_in_the_interpreter():
    """float32 and float16 (the interpreter rounds float32 to bfloat16 by truncation, where a GPU
    rounds to nearest even: bfloat16 is checked on CUDA)."""
    proc = run_check(ROTATE_CHECK + "\ncheck_rotate('cpu', [torch.float32, torch.float16])\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# The model's forward through the CUDA path (rotate_and_store, then the tiled kernel), run in the
# interpreter on CPU, against its reference path: a prefill of two sequences and two decode steps.
MODEL_CHECK = r"""
import sys, torch
from nanospec import LLM, triton_attention
from nanospec.kv_cache import KVCache, build_metadata

model = LLM(sys.argv[1], device="cpu", dtype="float32", kv_cache_gb=0.01).engine.model
cfg, cpu = model.config, torch.device("cpu")

def run(kernels):
    triton_attention.available = ((lambda q, k_cache=None: True) if kernels
                                  else (lambda q, k_cache=None: False))
    cache = KVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
    tables, cached, out = [[], []], [0, 0], []
    g = torch.Generator().manual_seed(0)
    for lens in ([7, 5], [1, 1], [1, 1]):
        for table, c, n in zip(tables, cached, lens):
            cache.allocator.grow(table, c + n)
        meta = build_metadata(tables, cached, lens, 4, cpu)
        ids = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g)
        hidden, _ = model(ids, meta.positions, cache, meta)
        out.append(hidden)
        cached = [c + n for c, n in zip(cached, lens)]
    return torch.cat(out), cache.pool

with torch.inference_mode():
    (h_kernels, pool_kernels), (h_ref, pool_ref) = run(True), run(False)
error = max(((a - b).norm() / b.norm()).item() for a, b in ((h_kernels, h_ref), (pool_kernels, pool_ref)))
print(error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_the_models_cuda_path_equals_its_reference_in_the_interpreter(checkpoints, family):
    """What a GPU runs of the model (one kernel rotating q and k and storing K/V, the tiled attention
    kernel over the pages) gives the reference path's hidden states and pages, float32, on the test
    checkpoints of each family (Qwen2's qkv bias, Qwen3's q/k norms)."""
    proc = subprocess.run([sys.executable, "-c", MODEL_CHECK, checkpoints[family]], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 1e-5


@pytest.mark.slow
def test_a_wrong_rotate_and_store_fails_the_check(tmp_path):
    """The check's power: the rotation without its half swap, a key head stored one head over, and
    the key heads normed with the query heads' weight."""
    assert broken_error(tmp_path, "(dims + HEAD_DIM // 2) % HEAD_DIM", "dims",
                        "'cpu', torch.float32, 4, 2, 32, 5, 'rows'", ROTATE_CHECK, "mismatches") > 0
    assert broken_error(tmp_path, "(head - heads) * HEAD_DIM + dims",
                        "(head - heads + 1) % kv_heads * HEAD_DIM + dims",
                        "'cpu', torch.float32, 4, 2, 32, 5, 'rows'", ROTATE_CHECK, "mismatches") > 0
    assert broken_error(tmp_path, "tl.load(k_norm_ptr + dims), tl.load(k_norm_ptr + partner)",
                        "tl.load(q_norm_ptr + dims), tl.load(q_norm_ptr + partner)",
                        "'cpu', torch.float32, 4, 2, 32, 5, 'rows'", ROTATE_CHECK, "norm_error") > 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rotate_and_store_is_the_rotation_and_writes_bit_for_bit_on_cuda():
    """Compiled, with fused multiply-adds off, it rounds as the eager ops do, bfloat16 included."""
    namespace = {}
    exec(ROTATE_CHECK, namespace)
    namespace["check_rotate"]("cuda", [torch.float32, torch.bfloat16, torch.float16])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_equal_the_reference_on_cuda_bf16():
    namespace = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", torch.bfloat16, 1e-2)
