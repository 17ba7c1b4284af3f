"""Measuring with the real engine: timing helpers (the device's queued work included) and a
dynamic-K profile, the step-time table ITL(batch, K) and acceptance per draft position.

Every measurement runs on engines built for it (twins of the given engine: the same weights and
proposer, a KV pool sized for the measurement, their own scheduler, statistics and K policy), so
the engine that serves requests is never touched. A profile's step times are taken with every
request verifying exactly the K drafts it asked for (ExactlyK), the K's taking turns a step at a
time so that a shared machine's drift and the contexts' growth hit every K alike.
"""
from __future__ import annotations

import itertools
import platform
import statistics
import time

import torch

from nanospec.cuda_graph import MAX_GRAPH_BATCH, GraphKey
from nanospec.dynamic_k import Profile
from nanospec.engine import Engine, SamplingParams
from nanospec.errors import NanospecError
from nanospec.k_policy import StaticK
from nanospec.proposer import OracleProposer


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


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(device, work):
    """(what work() returns, its seconds), the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    result = work()
    sync(device)
    return result, time.perf_counter() - start


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def greedy_requests(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> list:
    """Greedy requests of exactly max_new_tokens each (EOS ignored), queued on the engine."""
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    reqs = [engine.new_request(i, "", ids, params) for i, ids in enumerate(prompt_ids)]
    engine.add_requests(reqs)
    return reqs


def past_prefill(engine: Engine) -> None:
    """Step until no request is waiting or still in prefill."""
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()


def decoding(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> list:
    """Greedy requests (greedy_requests) queued and stepped past prefill and their first decode step
    (a proposer's catch-up, graphs of sampling steps: what a measurement leaves untimed); returns them."""
    requests = greedy_requests(engine, prompt_ids, max_new_tokens)
    past_prefill(engine)
    engine.step()
    return requests


def oracle_proposer(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> OracleProposer:
    """An OracleProposer of each prompt's plain greedy continuation, recorded on an engine of its
    own over the same weights (its KV pool just large enough)."""
    longest = max(map(len, prompt_ids)) + max_new_tokens
    blocks = len(prompt_ids) * engine.kv_cache.allocator.blocks_for(longest)
    twin = engine.twin(blocks, max_num_seqs=len(prompt_ids), k_policy=StaticK(0))
    requests = greedy_requests(twin, prompt_ids, max_new_tokens)
    twin.run_to_completion()
    return OracleProposer({tuple(r.prompt_ids): r.output_ids for r in requests})


def step_memory(engine: Engine, k: int) -> int:
    """Bytes the largest decode step takes beyond what exists: the largest graphed bucket at K = k,
    sampling with truncation (and draft probabilities, for a model proposer), run once eagerly on
    padding rows (the null and sink blocks only: a one-block engine will do). The CUDA graphs' shared pool
    holds about this much (captured largest first, the smaller graphs reuse it), so the KV cache
    is sized after it. 0 off CUDA, where no graph is kept (the step still runs, so CPU tests run it)."""
    steps, cuda = engine.step_graphs, engine.device.type == "cuda"
    bucket = max(b for b in steps.buckets if b <= MAX_GRAPH_BATCH)
    probs = k > 0 and steps.draft_tables is not None
    sync(engine.device)
    if cuda:
        base = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    steps.grow(k, probs=probs)
    steps.upload_padding(bucket, k)
    with torch.inference_mode():
        steps.verify_body(GraphKey("verify", bucket, k, True, probs), steps.tables.width)
    sync(engine.device)
    return torch.cuda.max_memory_allocated(engine.device) - base if cuda else 0


def context(engine: Engine) -> int:
    """The positions a measuring engine's requests may reach: its context, and the model's position
    tables (sized to the serving engine's KV pool, which a measuring twin's own pool may exceed)."""
    return min(engine.max_model_len, engine.model.config.max_position_embeddings)


def fit(prompt_ids: list[list[int]], room: int, what: str) -> list[list[int]]:
    """The prompts, each cut to its last `room` tokens, so that a measurement's requests fit the
    context."""
    if room < 1:
        raise NanospecError(f"the context ({room + 1} positions short of what it takes to {what} for a dynamic-K "
                            "profile) is too small: give a measured profile, or a larger KV cache or max_model_len")
    return [ids[-room:] for ids in prompt_ids]


class ExactlyK:
    """A proposer whose every request verifies exactly the K drafts it asked for. An n-gram proposer
    that finds no match drafts fewer (or none), and the step then costs what a smaller K costs;
    timed that way, a large K looks free and the policy picks it even where verifying K drafts is
    slow. Missing drafts are padded with token 0 (they are rejected; the requests are dropped after
    timing anyway)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def __getattr__(self, name):   # everything but propose is the real proposer's
        return getattr(self.proposer, name)

    def propose(self, requests, ks):
        proposal = self.proposer.propose(requests, ks)
        proposal.num_draft = list(ks)   # host drafts: the step pads them with 0 to max(ks)
        return proposal


def time_decode_steps(engine: Engine, prompt_ids: list[list[int]], batch_size: int, ks: list[int],
                      steps: int) -> list[float]:
    """For each k in ks, the median seconds of `steps` decode steps of batch_size requests (prompts
    cycled) verifying exactly k drafts each, on an engine of its own; prefilled first and one
    warm-up round (the first step also does the proposer's catch-up); the k's take turns a step at
    a time."""
    budget = sum((steps + 1) * (k + 1) for k in ks) + 1   # no request finishes while we time
    prompts = fit(prompt_ids, context(engine) - budget - 1, "time the steps")
    prompts = [prompts[i % len(prompts)] for i in range(batch_size)]
    blocks = batch_size * -(-(max(map(len, prompts)) + budget) // engine.kv_cache.block_size)
    engines = [engine.twin(blocks, max_num_seqs=batch_size, k_policy=StaticK(k),
                           proposer=ExactlyK(engine.proposer.twin(blocks))) for k in ks]
    for twin in engines:
        greedy_requests(twin, prompts, budget)
        past_prefill(twin)
    times = [[] for _ in ks]
    for _ in range(steps + 1):
        for twin, seconds in zip(engines, times):
            seconds.append(timed(engine.device, twin.step)[1])
    return [statistics.median(seconds[1:]) for seconds in times]


def measure_acceptance(engine: Engine, prompt_ids: list[list[int]], k: int,
                       max_new_tokens: int) -> tuple[list[float], list[float]]:
    """a_i and d_i, i < k, over the prompts run greedily at K = k, max_num_seqs at a time."""
    prompt_ids = fit(prompt_ids, context(engine) - max_new_tokens - 1, "measure acceptance")
    running = min(len(prompt_ids), engine.scheduler.max_num_seqs)
    blocks = running * -(-(max(map(len, prompt_ids)) + max_new_tokens) // engine.kv_cache.block_size)
    twin = engine.twin(blocks, k_policy=StaticK(k))
    greedy_requests(twin, prompt_ids, max_new_tokens)
    twin.run_to_completion()
    stats = twin.stats
    offered = stats.offered_per_position

    def per_offered(counts):
        return [round(counts[i] / offered[i], 4) if i < len(counts) and offered[i] else 0.0 for i in range(k)]
    return per_offered(stats.accepted_per_position), per_offered(stats.drafted_per_position)


def monotone_in_batch(itl: list[list[float]]) -> list[list[float]]:
    """More requests never take less time: the running maximum over the batch, so that timing
    noise (a median of a few steps) cannot make a larger batch look cheaper. Not over K: on a CPU
    verifying more tokens can really be cheaper (a 5-row matmul may beat a 3-row one), and the
    policy should see that."""
    columns = [list(itertools.accumulate(col, max)) for col in zip(*itl)]
    return [list(row) for row in zip(*columns)]


def measure_profile(engine: Engine, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int], steps: int,
                    max_new_tokens: int, meta: dict, log=None) -> Profile:
    """ITL over batch_sizes x ks and acceptance at max(ks), with the engine's model and proposer;
    meta: what was measured (target, proposer, ...), stored in the profile with the device."""
    if engine.proposer is None:
        raise NanospecError("a dynamic-K profile needs a proposer (a draft model, an EAGLE head or n-gram)")
    if max(batch_sizes) > engine.scheduler.max_num_seqs:
        raise NanospecError(f"batch size {max(batch_sizes)} is above max_num_seqs {engine.scheduler.max_num_seqs}")
    start = time.perf_counter()
    measured, spent = [], 0.0
    for i, b in enumerate(batch_sizes):
        measured.append([round(t, 6) for t in time_decode_steps(engine, prompt_ids, b, ks, steps)])
        if log:   # the time left, were every batch size to take as long as the largest so far
            spent, took = time.perf_counter() - start, time.perf_counter() - start - spent
            left = f", at least {took * (len(batch_sizes) - i - 1):.0f} s left" if i + 1 < len(batch_sizes) else ""
            log(f"profile: batch {b} ({i + 1}/{len(batch_sizes)}, {spent:.0f} s{left}): step ms "
                + " ".join(f"K{k}={1000 * t:.1f}" for k, t in zip(ks, measured[-1])))
    acceptance, drafted = measure_acceptance(engine, prompt_ids, max(ks), max_new_tokens)
    if log:
        log("acceptance per position: " + " ".join(f"{a:.2f}" for a in acceptance))
        log("drafts found per position: " + " ".join(f"{d:.2f}" for d in drafted))
    meta = {"device": device_name(engine.device), **meta, "num_prompts": len(prompt_ids), "steps_per_point": steps,
            "acceptance_tokens_per_prompt": max_new_tokens, "itl_s_measured": measured,
            "seconds": round(time.perf_counter() - start, 2)}
    profile = Profile(list(batch_sizes), list(ks), monotone_in_batch(measured), acceptance, meta, drafted)
    profile.check()
    return profile


def quick_profile(engine: Engine, prompt_ids: list[list[int]], max_k: int, meta: dict, max_num_seqs: int,
                  log=None) -> Profile:
    """The built-in profile measured at start-up when none is given: a coarse grid (batch 1, 8, 64,
    ... up to max_num_seqs; K 0, 1, 2, 3, 4, 6, 8 up to max_k), 9 steps a point (the median: a step's
    time moves +-20% on a shared CPU), acceptance over 8 prompts x 32 tokens. Interpolation fills in
    the rest; measured step times and online rates correct it while the engine runs. On a CPU the
    grid is coarser, so that it takes under a minute: batch 1, 8 and 32 and K 0, 1, 2, 4, 8 (on a
    2-core CPU the full grid took 112 s, 93 of them at batch 64, and 65 s stopped at batch 32; past
    its last batch a profile follows its last segment, and step times are linear enough in K)."""
    cuda = engine.device.type == "cuda"
    largest = max_num_seqs if cuda else min(max_num_seqs, 32)
    batch_sizes = sorted({b for b in (1, 8, 64) if b < largest} | {largest})
    ks = sorted({k for k in ((0, 1, 2, 3, 4, 6, 8) if cuda else (0, 1, 2, 4, 8)) if k < max_k} | {max_k})
    return measure_profile(engine, prompt_ids[:8], batch_sizes, ks, steps=9, max_new_tokens=32, meta=meta, log=log)
