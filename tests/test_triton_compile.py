"""Every Triton kernel variant the engine can launch compiles ahead of time, with no GPU, for sm_80
(A100) and sm_90 (H100), and none spills registers to local memory: ptxas -v (the one in the
triton wheel) on each variant's PTX reports "0 bytes spill stores, 0 bytes spill loads". A spill
turns a memory-bound kernel's registers into extra memory traffic, and a variant that fails to
build would fail only on the GPU, at the first step that launches it.

The variants are not listed by hand: they come from the launcher's own functions (tile_config,
tiled_constexprs, merge_constexprs) over every shape the engine can launch, so the list cannot
drift from what it runs. Identical variants compile once; the compiles run in a process pool.
Run with -s to see each variant's registers, spills and compile time."""
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from triton.backends.compiler import GPUTarget  # noqa: E402

from benchmarks import per_token_attention  # noqa: E402
from nanospec import triton_attention  # noqa: E402
from nanospec.llm import MAX_SPECULATIVE_TOKENS  # noqa: E402
from nanospec.tree import MAX_NODES  # noqa: E402

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEAD_DIMS = (64, 128)
GROUPS = (1, 4, 8)            # query heads per KV head: MHA, Llama-3-8B's 4, and 8
# the engine's default page (llm.EngineSizes); the tiled kernel's page arithmetic does not change its
# registers, so one size stands for all
BLOCK_SIZE = 16
# New tokens per sequence: 1 (decode), K + 1 (verify), and prefill chunks; past the rows one program
# takes, a chunk is cut into blocks whose tile no longer depends on its length, so 1024 covers all.
MAX_Q = range(1, max(MAX_SPECULATIVE_TOKENS + 2, MAX_NODES + 2, 1025))
CAPABILITIES = (80, 90)
SHARED_MEMORY = {80: 166912, 90: 232448}   # the most one block may use (163, 227 KiB): past it a launch fails


def engine_variants() -> set[tuple]:
    """(kernel name, constexprs, num_warps, dtype) of every launch the engine can make, and of the
    per-token kernel the GPU check times (benchmarks/per_token_attention.py)."""
    variants = set()
    for dtype, name in DTYPES.items():
        for head_dim in HEAD_DIMS:
            variants.add(("_paged_attention_kernel", (("BLOCK_SIZE", BLOCK_SIZE), ("HEAD_DIM", head_dim)), 4,
                          name))
            for norm in (False, True):   # Qwen3's q/k norms or none
                variants.add(("_rotate_store_kernel", (("HEAD_DIM", head_dim), ("NORM", norm)),
                              triton_attention.ROTATE_STORE_OPTIONS["num_warps"], name))
            for group in GROUPS:
                for max_q in MAX_Q:
                    tile = triton_attention.tile_config(max_q, group, head_dim, dtype)
                    for direct in (True, False):   # a split bound of 1, or of more
                        # a draft tree's mask on a verify step (K + 1 queries) or a drafter's frontier (1)
                        for tree in (False, True) if max_q <= MAX_NODES + 1 else (False,):
                            constexprs = triton_attention.tiled_constexprs(tile, head_dim, BLOCK_SIZE, dtype,
                                                                           direct, tree)
                            variants.add(("_tiled_kernel", tuple(constexprs.items()), tile.num_warps, name))
                    constexprs = triton_attention.merge_constexprs(tile, head_dim)
                    variants.add(("_merge_kernel", tuple(constexprs.items()), tile.num_warps, name))
    return variants


def arg_type(arg: str, dtype: str) -> str:
    """A kernel argument's Triton type, as the launchers pass it."""
    if arg in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "qk_ptr", "v_ptr", "q_out_ptr", "q_norm_ptr",
               "k_norm_ptr"):
        return "*" + dtype
    if arg in ("cos_ptr", "sin_ptr"):
        return "*fp32"            # the rotary tables
    if arg.startswith("part_"):
        return "*fp32"            # the splits' partial results
    if arg.endswith("_ptr"):
        return "*i64"             # block tables and the metadata: int64
    return "fp32" if arg in ("scale", "eps") else "i32"


def ptxas(capability: int) -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas   # the one Triton itself runs for this target
        return get_ptxas(capability).path
    except (ImportError, AttributeError, RuntimeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def build(job: tuple) -> dict:
    """Compile one variant for one capability; ptxas -v's registers and spill bytes."""
    (kernel_name, constexprs, num_warps, dtype), capability = job
    module = per_token_attention if kernel_name == "_paged_attention_kernel" else triton_attention
    kernel, constexprs = getattr(module, kernel_name), dict(constexprs)
    signature = {arg: "constexpr" if arg in constexprs else arg_type(arg, dtype) for arg in kernel.arg_names}
    # the launcher's tensors are 16-byte aligned, which Triton's launch specializes on: the same here
    attrs = {(i,): [["tt.divisibility", 16]]
             for i, arg in enumerate(kernel.arg_names) if signature[arg][0] == "*"}
    start = time.perf_counter()
    try:
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": num_warps}   # and the launcher's own options, as it launches the kernel
        options.update(triton_attention.ROTATE_STORE_OPTIONS if kernel_name == "_rotate_store_kernel" else {})
        binary = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
        ptx, shared = binary.asm["ptx"], binary.metadata.shared
        arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)   # sm_80, sm_90a
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas(capability), "-v", f"--gpu-name={arch}", path, "-o",
                                   path + ".cubin"], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
        registers = re.findall(r"Used (\d+) registers", proc.stderr)
        if not spills or not registers:
            raise RuntimeError(f"no register report in ptxas -v's output:\n{proc.stderr[-2000:]}")
        stores, loads = (sum(int(s[i]) for s in spills) for i in (0, 1))
        if shared > SHARED_MEMORY[capability]:
            raise RuntimeError(f"{shared} bytes of shared memory, more than sm_{capability} gives a block")
        return dict(job=job, error=None, stores=stores, loads=loads, registers=max(map(int, registers)),
                    shared=shared, seconds=time.perf_counter() - start)
    except Exception as e:   # reported by the test, with the variant
        return dict(job=job, error=f"{type(e).__name__}: {e}"[-3000:], seconds=time.perf_counter() - start)


def describe(result: dict) -> str:
    (kernel, constexprs, num_warps, dtype), capability = result["job"]
    shown = " ".join(f"{k}={v}" for k, v in constexprs)
    return f"sm_{capability} {kernel} {dtype} {shown} num_warps={num_warps}"


@pytest.fixture(scope="module")
def compiled():
    for capability in CAPABILITIES:
        if not os.access(ptxas(capability), os.X_OK):
            pytest.skip(f"no ptxas in this triton install ({ptxas(capability)}): "
                        f"cannot compile for sm_{capability}")
    jobs = [(variant, capability) for variant in sorted(engine_variants()) for capability in CAPABILITIES]
    start = time.perf_counter()
    methods = multiprocessing.get_all_start_methods()   # fork: the workers start without re-importing torch
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1), mp_context=context) as pool:
        results = list(pool.map(build, jobs))
    for r in results:
        print(f"{describe(r)}: " + (r["error"].splitlines()[0] if r["error"] else
              f"{r['registers']} registers, {r['shared']} bytes shared, "
              f"spills {r['stores']}/{r['loads']} bytes, "
              f"{r['seconds']:.1f} s"))
    print(f"{len(results)} compiles in {time.perf_counter() - start:.0f} s (triton {triton.__version__})")
    return results


def test_the_variants_cover_what_the_engine_launches():
    """Decode, verify and prefill tiles of each kernel, in each dtype: among them the 128-row tile at
    head_dim 128 (a verify step of K = 16 at GQA 8), which spilled before it got 8 warps."""
    variants = engine_variants()
    kernels = {(kernel, dtype) for kernel, _, _, dtype in variants}
    names = ("_tiled_kernel", "_merge_kernel", "_paged_attention_kernel", "_rotate_store_kernel")
    assert kernels == {(k, d) for k in names for d in DTYPES.values()}
    tiles = {(dict(c)["BLOCK_M"], dict(c)["HEAD_DIM"], dict(c)["DIRECT"]) for k, c, _, d in variants
             if k == "_tiled_kernel" and d == "bf16"}
    assert {(m, 128, direct) for m in (16, 32, 64, 128) for direct in (True, False)} <= tiles


@pytest.mark.slow
def test_every_variant_compiles(compiled):
    failed = [f"{describe(r)}:\n{r['error']}" for r in compiled if r["error"]]
    assert not failed, "\n\n".join(failed)


def test_no_variant_spills_registers(compiled):
    spilled = [f"{describe(r)}: {r['stores']} bytes spill stores, {r['loads']} bytes spill loads"
               for r in compiled if not r["error"] and (r["stores"] or r["loads"])]
    assert not spilled, "\n".join(spilled)
