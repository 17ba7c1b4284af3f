"""Suffix decoding's costs on the host: the global index's memory at 10,000 requests, and the time
its drafts take per step at batch 1, 64 and 256 next to a plain decode step of the target there.

Requests are 400-token windows (--request-tokens) of real token ids (the shipped prompts' own, in
the chat template, end to end), cut at random offsets with one token in 8 replaced at random, so
that no two are alike; each step drafts K = 16 for every request of the batch from a 512-token
context of the same kind, with the index full (10,000 requests). Memory: tracemalloc's count of
what the index holds (numpy reports its buffers to it), beside its own count (index_nbytes); the adds'
seconds on untraced builds, with the process's startup heap as it is and frozen as the server
freezes it (the slowest add: a seal's and a drop's copying, or a full garbage collection, which
scans the whole unfrozen heap: torch's objects and the model's).

  python -m benchmarks.suffix_costs --out bench_results/suffix_costs_cpu.json
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from types import SimpleNamespace

from benchmarks.measure import decoding, drafting_seconds, perturbed_window
from nanospec.cli import frozen_gc_heap, set_threads
from nanospec.llm import LLM
from nanospec.dynamic_k import device_name, timed, twin
from nanospec.prompts import shipped_prompts
from nanospec.suffix import GlobalIndex, SuffixProposer


def index_memory(corpus, num_requests: int, vocab: int, request_tokens: int = 400) -> dict:
    """The index built from the same requests three times: traced (its memory), then timed (each
    add's seconds; the slowest is a seal's and a drop's copying, or a full garbage collection) with
    the startup heap (torch, the model) as it is, and frozen as the server freezes it."""
    requests = lambda: (perturbed_window(corpus, request_tokens, rng, vocab)   # made as added: none kept
                        for rng in [random.Random(1)] for _ in range(num_requests))
    tracemalloc.start()
    index = GlobalIndex()
    for window in requests():
        index.add(window)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del index
    report = {"requests": num_requests, "tracemalloc_mb": round(held / 2**20, 1)}
    for frozen in (False, True):
        index, adds = timed_build(requests(), frozen)
        report["adds_startup_heap_frozen" if frozen else "adds"] = adds
    return {**report, "tokens": index.num_tokens, "segments": len(index.segments),
            "nbytes_mb": round(index_nbytes(index) / 2**20, 1),
            "bytes_per_token": round(held / index.num_tokens, 1), "index": index}


def index_nbytes(index: GlobalIndex) -> int:
    """Bytes the index holds: the sealed runs' arrays exactly, the open segment's stream, and its
    dict of position lists at CPython's sizes."""
    lists = sum(sys.getsizeof(k) + sys.getsizeof(v) + 28 * len(v) for k, v in index.open_follows.items())
    sealed = sum(run.tokens.nbytes + run.keys.nbytes + run.follows.nbytes for run in index.runs)
    return sealed + index.open_tokens.nbytes + sys.getsizeof(index.open_follows) + lists


def timed_build(requests, frozen: bool) -> tuple[GlobalIndex, dict]:
    """An index of the requests, each add timed, and the full (generation 2) garbage collections
    that ran meanwhile; frozen: inside frozen_gc_heap(), as the server runs."""
    pauses, started = [], []

    def watch(phase, info):
        if info["generation"] == 2 and phase == "start":
            started.append(time.perf_counter())
        elif info["generation"] == 2:
            pauses.append(time.perf_counter() - started[-1])
    index, adds = GlobalIndex(), []
    with frozen_gc_heap() if frozen else contextlib.nullcontext():
        gc.callbacks.append(watch)
        try:
            for window in requests:
                start = time.perf_counter()
                index.add(window)
                adds.append(time.perf_counter() - start)
        finally:
            gc.callbacks.remove(watch)
    return index, {"seconds_each": sum(adds) / len(adds), "seconds_slowest": max(adds),
                   "full_collections": len(pauses),
                   "full_collection_seconds_slowest": max(pauses, default=0.0)}


def draft_time(index: GlobalIndex, corpus, batch: int, rng, vocab: int, repeats: int = 5) -> float:
    """Median seconds of one step's drafts (K = 16) for `batch` requests of 512-token contexts."""
    proposer = SuffixProposer(None)
    proposer.global_index = index
    requests = [SimpleNamespace(tokens=perturbed_window(corpus, 512, rng, vocab), suffix_stream=None)
                for _ in range(batch)]
    return drafting_seconds(proposer, requests, 16, lambda: rng.choice(corpus), repeats)


def step_time(llm: LLM, batch: int, repeats: int = 3) -> float:
    """Median seconds of a plain decode step of `batch` requests (32-token prompts)."""
    engine = twin(llm.engine, max_num_seqs=batch)
    decoding(engine, [llm.encode_prompt("Write a long story about the sea.", chat=True)[:32]] * batch, 64)
    return statistics.median(timed(llm.device, engine.step)[1] for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--request-tokens", type=int, default=400,
                    help="tokens a request adds to the index (840 fills its 2^23-token bound)")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args()
    set_threads(None)
    rng = random.Random(0)
    llm = LLM()
    corpus = [t for row in shipped_prompts() for t in llm.encode_prompt(row["prompt"], chat=True)]
    memory = index_memory(corpus, args.requests, llm.vocab_size, args.request_tokens)
    index = memory.pop("index")
    print(f"global index at {args.requests} requests: {memory}", file=sys.stderr)
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        drafts, step = draft_time(index, corpus, batch, rng, llm.vocab_size), step_time(llm, batch)
        rows.append({"batch_size": batch, "suffix_drafts_ms": round(drafts * 1e3, 2),
                     "plain_decode_step_ms": round(step * 1e3, 1),
                     "drafts_over_step": round(drafts / step, 4)})
        print(rows[-1], file=sys.stderr)
    report = {"command": "python -m benchmarks.suffix_costs " + " ".join(sys.argv[1:]),
              "device": device_name(llm.device),
              "target": llm.target_name, "global_index": memory, "host_time_per_step": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
