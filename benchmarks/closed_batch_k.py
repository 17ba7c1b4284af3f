"""A closed batch (every request sent at once, the same max_tokens, ignore_eos): where its time goes
under plain decoding, static K = 1 and dynamic K (n-gram, its quick profile at start-up). For each:
tokens/s, the engine's steps, prefill and verify time, the mean verify step, the rest of the steps
(scheduling, the K policy, commit) and each request's decode steps; alternated, --rounds rounds
(the prompts repeat, so from round 2 on the prefix cache holds them). A closed batch ends with its slowest
request: drafts accepted only make the fast requests end sooner, and the batch then shrinks, which a
step's cost on this CPU barely rewards (docs/results.md, "Dynamic K in a closed batch").

    python -m benchmarks.closed_batch_k [--batch 32] [--rounds 2] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from nanospec import LLM, SamplingParams
from nanospec.prompts import shipped_prompts

TIMED = ("step", "run_prefill", "run_verify")


def timed_chat(llm: LLM, conversations, params) -> dict:
    """llm.chat with the engine's TIMED methods wrapped: their seconds and calls, the wall time, tokens."""
    engine, totals, real, request_steps = llm.engine, collections.Counter(), {}, []

    def finish(req, *args, **kwargs):   # each request's decode steps, as it ends
        request_steps.append(req.decode_steps)
        return type(engine).finish(engine, req, *args, **kwargs)

    def timed(name):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real[name](*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start
                totals[name + " calls"] += 1
        return wrapped
    try:
        engine.finish = finish
        for name in TIMED:
            real[name] = getattr(engine, name)
            setattr(engine, name, timed(name))
        start = time.perf_counter()
        outputs = llm.chat(conversations, params)
        wall = time.perf_counter() - start
    finally:
        for name in (*TIMED, "finish"):
            engine.__dict__.pop(name, None)   # the instance's wrapper goes; the class's method shows again
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "steps": totals["step calls"],
            "verify_steps": totals["run_verify calls"], "prefill_s": totals["run_prefill"],
            "verify_s": totals["run_verify"],
            "verify_step_ms": 1e3 * totals["run_verify"] / totals["run_verify calls"],
            "rest_s": totals["step"] - totals["run_prefill"] - totals["run_verify"],
            "request_steps": sorted(request_steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    conversations = [[{"role": "user", "content": r["prompt"]}] for r in shipped_prompts()][:args.batch]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"plain": LLM(dtype="float32", max_num_seqs=args.batch),
               "K=1": LLM(dtype="float32", ngram=True, num_speculative_tokens=1, max_num_seqs=args.batch),
               "dynamic": LLM(dtype="float32", ngram=True, dynamic_k=True, max_num_seqs=args.batch)}
    rows = []
    for round_ in range(args.rounds):
        for name, llm in engines.items():
            row = {"round": round_, "engine": name, **timed_chat(llm, conversations, params)}
            rows.append(row)
            print(f"round {round_} {name:8s}: {row['tokens_per_s']:6.1f} tok/s; {row['verify_steps']} verify "
                  f"steps of {row['verify_step_ms']:.0f} ms, prefill {row['prefill_s']:.2f} s, rest "
                  f"{row['rest_s']:.2f} s; a request's decode steps {min(row['request_steps'])} to "
                  f"{max(row['request_steps'])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.closed_batch_k " + " ".join(sys.argv[1:]),
                       "batch": len(conversations), "max_tokens": args.max_tokens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
