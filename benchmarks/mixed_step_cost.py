"""Would a prefill chunk ride for free in a decode step? The target's forward over (a) B decode
tokens, (b) one prefill chunk of C tokens, (c) both in one pass (a mixed step, as vLLM schedules
them), on the real model: where (c) costs about (a), mixing hides the prefill that otherwise stalls
the running streams between their tokens; where (c) costs about (a) + (b), it does not. The three
are timed in turn, --rounds times, medians. Decode rows sit at a context of 200 tokens, the chunk
after 256 cached ones.

    python -m benchmarks.mixed_step_cost [--batches 1,4,8] [--chunks 16,32,64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from benchmarks.measure import cpu_flags
from nanospec import LLM
from nanospec.kv_cache import BlockTable, build_metadata

CONTEXT, CHUNK_AFTER = 200, 256


def forward(llm: LLM, rows: list[tuple[BlockTable, int, int]]) -> None:
    """One target forward over rows of (table, cached, new tokens), and the LM head at one row each."""
    engine = llm.engine
    meta = build_metadata([list(t) for t, _, _ in rows], [c for _, c, _ in rows], [n for _, _, n in rows],
                          engine.kv_cache.block_size, engine.device, extra=[1] * sum(n for *_, n in rows))
    with torch.inference_mode():
        hidden, _ = engine.model(meta.extra, meta.positions, engine.kv_cache, meta, ())
        engine.model.logits(hidden[meta.query_start[1:] - 1])


def milliseconds(llm: LLM, rows, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        forward(llm, rows)
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--chunks", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="forwards timed together, a round")
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    batches, chunks = [int(b) for b in args.batches.split(",")], [int(c) for c in args.chunks.split(",")]
    llm = LLM(dtype="float32", max_num_seqs=max(batches))
    allocator = llm.engine.kv_cache.allocator
    decoding = [BlockTable() for _ in range(max(batches))]
    prefilling = BlockTable()
    for table in decoding:
        allocator.grow(table, CONTEXT + 1)
    allocator.grow(prefilling, CHUNK_AFTER + max(chunks))
    rows = []
    for batch in batches:
        for chunk in chunks:
            parts = {"decode": [(t, CONTEXT, 1) for t in decoding[:batch]],
                     "chunk": [(prefilling, CHUNK_AFTER, chunk)]}
            parts["mixed"] = parts["decode"] + parts["chunk"]
            times = {name: [] for name in parts}
            for _ in range(args.rounds):
                for name, part in parts.items():
                    times[name].append(milliseconds(llm, part, args.repeats))
            ms = {name: statistics.median(t) for name, t in times.items()}
            row = {"batch": batch, "chunk": chunk, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                   "mixed_over_decode": round(ms["mixed"] / ms["decode"], 3),
                   "saved_ms": round(ms["decode"] + ms["chunk"] - ms["mixed"], 2)}
            rows.append(row)
            print(f"batch {batch:2d}, chunk {chunk:3d}: decode {ms['decode']:6.1f} ms, "
                  f"chunk {ms['chunk']:6.1f} ms, mixed {ms['mixed']:6.1f} ms "
                  f"({row['mixed_over_decode']:.2f}x decode; one pass saves {row['saved_ms']:.1f} ms)",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.mixed_step_cost " + " ".join(sys.argv[1:]),
                       "cpu": platform.processor() or platform.machine(),
                       "cpu_flags": cpu_flags(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "model": "SmolLM2-135M-Instruct, float32",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
