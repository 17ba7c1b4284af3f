"""Measuring helpers only the harnesses use: requests stepped past prefill, the host proposers'
drafting time, and the CPU's flags a result is read against. The profiler's own helpers (timed,
greedy_requests, past_prefill) are nanospec.dynamic_k's."""
from __future__ import annotations

import statistics
import time

from nanospec.dynamic_k import greedy_requests, past_prefill
from nanospec.engine import Engine


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
