"""What mixed steps buy and cost, without HTTP: one engine scheduled as the server schedules it
(decode_between_prefills, and --mixed-prefill-tokens N), fed as a closed-loop client feeds a server
at --concurrency C: the first request alone, the other C - 1 landing while its prefill runs, and each
finished request replaced by a new one at the next step, 2C requests of the shipped chat prompts in
all, 64 tokens each with ignore_eos, greedy. Per setting: the wall time, and each request's gaps
between steps that gave it tokens (ITL p50 / p99) and its TPOT (its time from the first token to the
last over the tokens after the first), p50 over the requests. The settings run in turn, --rounds
times, medians.

    python -m benchmarks.mixed_step_itl [--mixed 0,8,32] [--concurrency 16] [--rounds 3] [--out FILE.json]
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
from nanospec import LLM, SamplingParams
from nanospec.prompts import shipped_prompts


def closed_loop(llm: LLM, concurrency: int, max_tokens: int) -> dict:
    """One run of 2 * concurrency requests; returns its figures (seconds)."""
    engine, prompts = llm.engine, [r["prompt"] for r in shipped_prompts()]
    made = []

    def arrive(n: int) -> None:
        for _ in range(n):
            prompt = prompts[len(made) % len(prompts)]
            made.append(engine.new_request(len(made), prompt, llm.encode_prompt(prompt), SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True)))
            engine.add_requests(made[-1:])

    arrive(1)
    times, start = {}, time.perf_counter()
    while engine.scheduler.has_work():
        for req in engine.step():
            times.setdefault(req.index, []).append(time.perf_counter())
        # what lands while a step runs (the first wave during the first request's prefill, then each
        # finished request's successor) is seen by the next schedule
        running = sum(r.finish_reason is None for r in made)
        arrive(min(concurrency - running, 2 * concurrency - len(made)))
    gaps = sorted(b - a for ts in times.values() for a, b in zip(ts, ts[1:]))
    tpot = statistics.median((ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1)
    return {"seconds": time.perf_counter() - start, "requests": len(made),
            "output_tokens": sum(len(r.output_ids) for r in made), "itl_p50": gaps[len(gaps) // 2],
            "itl_p99": gaps[int(0.99 * (len(gaps) - 1))], "tpot_p50": tpot}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixed", default="0,8,32", help="--mixed-prefill-tokens values (0: no mixed steps)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="as the server's default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    settings = [int(n) for n in args.mixed.split(",")]
    llm = LLM(dtype="float32", max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens)
    scheduler = llm.engine.scheduler
    scheduler.decode_between_prefills = True
    closed_loop(llm, 2, 8)   # warm-up
    rows = []
    for round_ in range(args.rounds):
        for n in settings if round_ % 2 == 0 else settings[::-1]:
            scheduler.mixed_prefill_tokens = n
            rows.append({"mixed_prefill_tokens": n, "round": round_,
                         **closed_loop(llm, args.concurrency, args.max_tokens)})
            print(json.dumps(rows[-1]), flush=True)
    medians = []
    for n in settings:
        mine = [r for r in rows if r["mixed_prefill_tokens"] == n]
        median = {key: statistics.median(r[key] for r in mine) for key in ("seconds", "itl_p50", "itl_p99",
                                                                           "tpot_p50")}
        medians.append({"mixed_prefill_tokens": n, **median,
                        "itl_p99_over_tpot_p50": statistics.median(r["itl_p99"] / r["tpot_p50"]
                                                                   for r in mine),
                        "seconds_over_unmixed": statistics.median(
                            r["seconds"] / next(o["seconds"] for o in rows if o["round"] == r["round"]
                                                and o["mixed_prefill_tokens"] == settings[0]) for r in mine)})
        print(json.dumps(medians[-1]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.mixed_step_itl " + " ".join(
                sys.argv[1:] if argv is None else argv), "cpu_flags": cpu_flags(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "python": platform.python_version(),
                "medians": medians, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
