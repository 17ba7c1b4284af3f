"""One command that validates a GPU: `python -m nanospec.bench --gpu-check` runs the CUDA tests and
the headline measurements and writes them, with the device and versions, to
bench_results/gpu_check_<device>.json. On a CPU it runs a reduced mode (a tiny random model, small
batches, no test run) and says what it skipped.

Measured (random:llama3-8b in bfloat16 on a GPU; random:tiny in float32 on a CPU):
- the device's copy bandwidth (a device-to-device copy: bytes read + written per second);
- plain decoding at batch 1: tokens/s, and the bytes a step reads (weights + KV cache) per second
  as a fraction of that bandwidth (the roofline);
- the oracle proposer (every draft accepted) at K = 2 and 4 against plain decoding, at batch 1,
  16, 64 and 256, with CUDA graphs;
- the decode step with CUDA graphs and eagerly (enforce_eager) at K = 0 and 4, the same batches, for
  random:llama3-8b and random:qwen3-0.6b;
- the tiled attention kernel alone: KV bytes read per second at contexts 1k, 4k, 16k;
- a prefill chunk's attention by the tiled kernel, the per-token kernel and SDPA over gathered pages;
- a draft model (random:llama3.2-1b, K = 4) against transformers' assisted generation on the same
  weights, batch 1: the ratio of tokens/s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import torch

from nanospec.llm import LLM
from nanospec.baseline import time_transformers, transformers_model
from nanospec.engine import SamplingParams
from nanospec.k_policy import StaticK
from nanospec.measure import device_name, greedy_requests, oracle_proposer, sync, timed
from nanospec.prompts import shipped_prompts

# new_tokens: a multiple of every K + 1, so the oracle rows gain exactly K + 1 tokens a step
CUDA_TESTS = ["tests/test_cuda_graph.py", "tests/test_step_copies.py", "tests/test_triton_attention.py"]
FULL = dict(target="random:llama3-8b", dtype="bfloat16", batches=[1, 16, 64, 256], ks=[2, 4], new_tokens=30,
            assisted=("random:llama3-8b", "random:llama3.2-1b"))
SMALL_TARGET = "random:qwen3-0.6b"   # graphs against eager on a small model too, where launches weigh most
REDUCED = dict(target="random:tiny", dtype="float32", batches=[1, 4], ks=[2, 4], new_tokens=15,
               assisted=("random:tiny", "random:tiny"))


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second a device-to-device copy reads and writes, best of 5."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / best_seconds(device, lambda: dst.copy_(src), 5)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())   # a tied weight counts once


def kv_bytes_per_token(model) -> int:
    cfg, size = model.config, next(model.parameters()).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * size


def llama8b_layer(device: torch.device, dtype: torch.dtype, batch: int, cached: int, new: int, block_size: int = 16):
    """One attention layer of Llama-3.1-8B's shape (32 query heads, 8 KV heads, head_dim 128) over
    random pages: batch sequences of `cached` tokens adding `new` each. Returns (q, k_cache, v_cache, meta)."""
    from nanospec.kv_cache import KVCache, build_metadata
    per_seq = (cached + new) // block_size + 1
    cache = KVCache(1, batch * per_seq, block_size, 8, 128, dtype, device)
    cache.pool.normal_()
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    meta = build_metadata(tables, [cached] * batch, [new] * batch, block_size, device)
    return torch.randn(batch * new, 32, 128, dtype=dtype, device=device), *cache.layer(0), meta


def best_seconds(device: torch.device, run, repeats: int) -> float:
    run()   # warm-up (a kernel's compile)
    return min(timed(device, run)[1] for _ in range(repeats))


def attention_bandwidth(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The tiled attention kernel alone, one layer of Llama-3.1-8B's shape: the KV bytes it reads per
    second at contexts 1k, 4k, 16k, batch 1 and 64, K 0 and 4 (K + 1 new tokens per sequence)."""
    from nanospec.triton_attention import paged_attention
    rows = []
    for context in (1024, 4096, 16384):
        for batch in (1, 64):
            for k in (0, 4):
                q, k_cache, v_cache, meta = llama8b_layer(device, dtype, batch, context - k - 1, k + 1)
                seconds = best_seconds(device, lambda: paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5), 5)
                kv_bytes = batch * context * 2 * 8 * 128 * k_cache.element_size()
                rows.append({"context": context, "batch": batch, "k": k, "us": round(1e6 * seconds, 1),
                             "kv_gb_s": round(kv_bytes / seconds / 1e9, 1)})
    return rows


def prefill_attention(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Attention of a prefill chunk, one layer of Llama-3.1-8B's shape, by the three candidates:
    the tiled kernel (what runs), the per-token kernel, and the reference's SDPA over gathered pages."""
    from nanospec.kv_cache import paged_attention_reference
    from nanospec.triton_attention import paged_attention, paged_attention_tokens
    rows = []
    for batch, cached, new in ((1, 3072, 1024), (8, 0, 512)):
        q, k_cache, v_cache, meta = llama8b_layer(device, dtype, batch, cached, new)
        kernels = {"tiled": lambda: paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5),
                   "per_token": lambda: paged_attention_tokens(q, k_cache, v_cache, meta.block_tables, meta.token_seq,
                                                               meta.positions, 128 ** -0.5),
                   "sdpa_gathered": lambda: paged_attention_reference(q, k_cache, v_cache, meta, 128 ** -0.5)}
        row = {"batch": batch, "cached": cached, "new": new}
        for name, run in kernels.items():
            row[f"{name}_ms"] = round(1000 * best_seconds(device, run, 3), 3)
        rows.append(row)
    return rows


def decode(llm, prompts: list[list[int]], k: int, new_tokens: int, oracle, graphs: bool) -> dict:
    """Greedy decoding of the prompts at once on an engine of their batch size (with the oracle
    proposer where k > 0); the decode steps' seconds, as the bench counts them."""
    longest = max(map(len, prompts)) + new_tokens + k + 1
    blocks = len(prompts) * llm.engine.kv_cache.allocator.blocks_for(longest)
    engine = llm.engine.twin(blocks, max_num_seqs=len(prompts), k_policy=StaticK(k), proposer=oracle if k else None,
                             use_graphs=graphs)
    engine.step_graphs.capture_all([k])
    greedy_requests(engine, prompts, new_tokens)
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    engine.step()   # a first decode step: graphs it has not captured yet
    seconds, steps, tokens = 0.0, 0, sum(len(r.output_ids) for r in engine.scheduler.running)
    while engine.scheduler.has_work():
        seconds += timed(llm.device, engine.step)[1]
        steps += 1
    tokens = len(prompts) * new_tokens - tokens
    return {"batch": len(prompts), "k": k, "graphs": engine.use_graphs, "step_ms": round(1000 * seconds / steps, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "mean_acceptance_length": engine.stats.as_dict()["mean_acceptance_length"]}


def measure_rows(target: str, plan: dict, reduced: bool, log) -> tuple:
    """The decode rows of one target: K = 0 and plan["ks"] (oracle drafts) at every batch, with
    graphs, and eagerly too at K 0 and 4 on CUDA. Returns (the LLM, its prompts, the rows)."""
    # the LLM's own engine only records the oracle's continuations: no graphs of its own
    llm = LLM(target, device="cpu" if reduced else "cuda", dtype=plan["dtype"], max_num_seqs=max(plan["batches"]),
              kv_cache_gb=0.05 if reduced else 8, enforce_eager=True)
    cuda = llm.device.type == "cuda"
    texts = [row["prompt"] for row in shipped_prompts()]
    prompts = [llm.encode_prompt(texts[i % len(texts)])[:64] for i in range(max(plan["batches"]))]
    oracle = oracle_proposer(llm.engine, prompts, plan["new_tokens"] + max(plan["ks"]) + 1)
    rows = []
    for batch in plan["batches"]:
        for k in [0, *plan["ks"]]:
            rows.append(decode(llm, prompts[:batch], k, plan["new_tokens"], oracle, graphs=cuda))
            log(json.dumps(rows[-1]))
            if cuda and k in (0, 4):
                rows.append(decode(llm, prompts[:batch], k, plan["new_tokens"], oracle, graphs=False))
                log(json.dumps(rows[-1]))
    for r in rows:
        base = next(p for p in rows if p["batch"] == r["batch"] and p["k"] == 0 and p["graphs"] == r["graphs"])
        r["speedup_vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return llm, prompts, rows


def assisted_ratio(plan: dict, device: torch.device, log) -> dict:
    """nanospec with a draft model against transformers' assisted generation, both on the same
    random target and draft weights (greedy, batch 1, K = 4): tokens/s and their ratio."""
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers' assisted generation (transformers is not installed)"}
    target, draft = plan["assisted"]
    llm = LLM(target, draft=draft, num_speculative_tokens=4, device=device, dtype=plan["dtype"], max_num_seqs=1,
              kv_cache_gb=0.05 if device.type == "cpu" else 2)
    prompt = llm.encode_prompt(shipped_prompts()[0]["prompt"])[:64]
    params = SamplingParams(temperature=0, max_tokens=plan["new_tokens"], ignore_eos=True)
    llm.generate([prompt], params)   # warm-up: graphs, compiles
    ours = plan["new_tokens"] / timed(device, lambda: llm.generate([prompt], params))[1]
    acceptance = llm.stats["mean_acceptance_length"]
    ref = transformers_model(target, llm.dtype, device, llm.model)
    assistant = transformers_model(draft, llm.dtype, device, llm.engine.proposer.model)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    pad = llm.tokenizer.eos_ids[0]
    time_transformers(ref, [prompt], 1, 4, pad, assistant_model=assistant)   # warm-up
    theirs = time_transformers(ref, [prompt], 1, plan["new_tokens"], pad, assistant_model=assistant)
    row = {"target": target, "draft": draft, "k": 4, "batch": 1, "nanospec_tokens_per_s": round(ours, 2),
           "mean_acceptance_length": acceptance, "transformers_tokens_per_s": round(theirs, 2),
           "ratio": round(ours / theirs, 3)}
    log(json.dumps(row))
    return row


def run_tests(reduced: bool) -> dict:
    if reduced:
        return {"skipped": "no CUDA: the CUDA tests skip here (CI runs the rest)"}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
                              capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        return {"command": "python -m pytest -q " + " ".join(CUDA_TESTS), "summary": "timed out after 400 s"}
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|error)", tail)}
    return {"command": "python -m pytest -q " + " ".join(CUDA_TESTS), "returncode": proc.returncode,
            "summary": tail, **counts, "seconds": round(time.perf_counter() - start, 1)}


def gpu_check(device: str = "auto", out: str | None = None, log=print) -> dict:
    """Run the check; writes its report to `out` (default: bench_results/gpu_check_<device>.json)
    and returns it."""
    reduced = not (device in ("auto", "cuda") and torch.cuda.is_available())
    plan = REDUCED if reduced else FULL
    tests = run_tests(reduced)
    log(f"CUDA tests: {tests.get('summary', tests.get('skipped'))}")
    llm, prompts, rows = measure_rows(plan["target"], plan, reduced, log)
    device, dtype, cuda = llm.device, llm.dtype, llm.device.type == "cuda"
    bandwidth = copy_bandwidth(device, 64 if reduced else 1024)
    plain = next(r for r in rows if r["batch"] == 1 and r["k"] == 0 and r["graphs"] == cuda)
    context = sum(map(len, prompts[:1])) + plan["new_tokens"] / 2   # the mean context of the batch-1 run
    step_bytes = weight_bytes(llm.model) + context * kv_bytes_per_token(llm.model)
    del llm   # one large model at a time
    small_rows = [] if reduced else measure_rows(SMALL_TARGET, dict(plan, ks=[4]), reduced, log)[2]
    attention = [] if reduced else attention_bandwidth(device, dtype)
    prefill = [] if reduced else prefill_attention(device, dtype)
    for row in attention + prefill:
        log(json.dumps(row))
    assisted = assisted_ratio(plan, device, log)
    report = {
        "command": "python -m nanospec.bench --gpu-check", "device": device_name(device),
        "mode": "reduced (no CUDA)" if reduced else "full", "target": plan["target"], "dtype": plan["dtype"],
        "torch": torch.__version__, "python": sys.version.split()[0], "cuda_tests": tests,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "plain_batch1": {"tokens_per_s": plain["tokens_per_s"], "bytes_per_step": int(step_bytes),
                         "fraction_of_copy_bandwidth": round(step_bytes / (plain["step_ms"] / 1000) / bandwidth, 3)},
        "rows": rows, "small_target": None if reduced else SMALL_TARGET, "small_target_rows": small_rows,
        "attention_kernel": attention, "prefill_attention": prefill, "transformers_assisted": assisted,
        "skipped": (["the CUDA tests", "CUDA graphs (a CPU runs every step eagerly)", "random:llama3-8b (too slow here)",
                     "the attention kernels alone (Triton needs CUDA)"] if reduced else [])
                   + ([assisted["skipped"]] if "skipped" in assisted else []),
    }
    slug = re.sub(r"[^a-z0-9]+", "_", report["device"].lower()).strip("_") or "device"
    path = out or os.path.join("bench_results", f"gpu_check_{slug}{'_reduced' if reduced else ''}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    sync(device)
    log(f"plain decoding at batch 1: {plain['tokens_per_s']} tokens/s, "
        f"{report['plain_batch1']['fraction_of_copy_bandwidth']:.0%} of the copy bandwidth "
        f"({report['copy_bandwidth_gb_s']} GB/s); wrote {path}")
    for line in report["skipped"]:
        log(f"skipped: {line}")
    return report
