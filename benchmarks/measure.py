"""Measuring helpers only the harnesses use: a kernel's and a copy's time by the device's own timers,
requests stepped past prefill, the host proposers' drafting time, and the CPU's flags a result is
read against. The profiler's own helpers (timed, greedy_requests, past_prefill) are nanospec.dynamic_k's."""
from __future__ import annotations

import json
import statistics
import time

import torch

from nanospec.dynamic_k import greedy_requests, past_prefill
from nanospec.engine import Engine
from nanospec.errors import run_command


def run_and_report(run, args) -> int:
    """A harness's command: run(args)'s report as JSON on stdout and, with --out, in that file; a
    NanospecError is one line and exit status 2 (errors.run_command)."""
    def work() -> int:
        report = run(args)
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        return 0
    return run_command(work)


def kernel_seconds(device: torch.device, run, launches: int = 20) -> tuple[float, str]:
    """Seconds one call of run() takes, over many launches, and the timer's name: on CUDA
    triton.testing.do_bench (CUDA events, the L2 cache cleared between launches, the median), or
    CUDA events around `launches` calls where Triton cannot run; on a CPU a perf_counter loop."""
    run()   # warm-up: a kernel's compile
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
            return do_bench(run, warmup=25, rep=100, return_mode="median") / 1000, "triton.testing.do_bench"
        except Exception:   # no triton, or one that cannot build its launcher: CUDA events alone
            pass
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / launches, f"cuda events over {launches} launches"
    start = time.perf_counter()
    for _ in range(launches):
        run()
    return (time.perf_counter() - start) / launches, f"perf_counter over {launches} calls"


def time_copy(device: torch.device, megabytes: int) -> tuple[float, str]:
    """Bytes per second a device-to-device copy reads and writes, and the timer's name."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, timer = kernel_seconds(device, lambda: dst.copy_(src), launches=5)
    return 2 * src.numel() / seconds, timer


def cpu_flags() -> list[str]:
    """The CPU's vector extensions (avx2, avx512f, avx512_bf16 ...): they decide the compute rate."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":")[1].split() for line in f if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx")))


def perturbed_window(corpus: list[int], length: int, rng, vocab: int) -> list[int]:
    """`length` tokens of corpus from a random offset, one in every 8 replaced by a random id below
    vocab, so that no two windows are alike (requests for the host proposers' drafting costs)."""
    start = rng.randrange(len(corpus) - length)
    out = corpus[start:start + length]
    for i in range(0, length - 7, 8):
        out[i + rng.randrange(8)] = rng.randrange(vocab)
    return out


def drafting_seconds(proposer, requests, k: int, next_token, repeats: int) -> float:
    """Median seconds of one decode step's host drafts (K = k for every request), each request a
    token (next_token()) longer every step; the first drafts, the indexes' build, are a prefill's
    work and go untimed."""
    proposer.propose(requests, [k] * len(requests))
    times = []
    for _ in range(repeats):
        for r in requests:
            r.tokens.append(next_token())
        start = time.perf_counter()
        proposer.propose(requests, [k] * len(requests))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def clocked(totals, name: str, fn):
    """fn, adding each call's wall-clock seconds into totals[name] (a Counter)."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return run


def decoding(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> list:
    """Greedy requests (greedy_requests) queued and stepped past prefill and their first decode step
    (a proposer's catch-up, graphs of sampling steps: what a measurement leaves untimed); returns them."""
    requests = greedy_requests(engine, prompt_ids, max_new_tokens)
    past_prefill(engine)
    engine.step()
    return requests
