"""Does compiling the whole model help a CPU decode step? Plain greedy decoding of SmolLM2 at batch 1,
the model's forward eager against torch.compile'd (inductor, dynamic shapes: the context grows every
step), as gpt-fast compiles its step. Engines of their own, one request each, the two taking turns
`--rounds` times after the compile; each round times `--steps` decode steps (medians) and checks
that both decoded the same tokens.

The compiled forward runs nn.Linear's plain F.linear for more than two rows (inductor cannot lower
the oneDNN packed product, cpu_linear.Linear's fast path); decode steps of one row take the same W @ x.T
path in both.

    python -m benchmarks.compiled_step [--steps 60] [--rounds 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from nanospec import LLM, SamplingParams, cpu_linear
from nanospec.cli import set_threads
from nanospec.dynamic_k import twin

PROMPT = "Write a short story about a robot who learns to paint."


def decode(llm, forward, steps: int) -> tuple[list[float], list[int]]:
    """One request on an engine of its own, prefilled, then `steps` timed decode steps."""
    engine = twin(llm.engine, max_num_seqs=1)
    engine.model = forward
    ids = llm.encode_prompt(PROMPT, chat=True)
    req = engine.new_request(0, PROMPT, ids,
                             SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    engine.add_requests([req])
    engine.step()           # the prefill
    for _ in range(3):      # warm-up steps
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times, req.output_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    set_threads(None)
    llm = LLM(device="cpu", dtype="float32")
    cpu_linear.PACKED_LINEAR = False   # inductor cannot lower the packed product (see the top)
    compiled = torch.compile(llm.model, dynamic=True)
    start = time.perf_counter()
    decode(llm, compiled, 4)   # compiles (prefill and decode shapes)
    compile_s = time.perf_counter() - start
    rows = []
    for r in range(args.rounds):
        eager_t, eager_out = decode(llm, llm.model, args.steps)
        comp_t, comp_out = decode(llm, compiled, args.steps)
        rows.append({"round": r + 1, "eager_step_ms": round(1000 * statistics.median(eager_t), 2),
                     "compiled_step_ms": round(1000 * statistics.median(comp_t), 2),
                     "same_tokens": eager_out == comp_out})
        print(rows[-1], file=sys.stderr, flush=True)
    report = {"what": "SmolLM2-135M float32, plain greedy decoding at batch 1, median decode step",
              "command": "python -m benchmarks.compiled_step " + " ".join(sys.argv[1:]),
              "torch": torch.__version__,
              "threads": torch.get_num_threads(), "compile_seconds": round(compile_s, 1), "rounds": rows}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
