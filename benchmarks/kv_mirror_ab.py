"""The CPU attention's mirror (nanospec/kv_mirror.py) on and off, side by side in one process: two
engines of the same model, each built once (the mirror's lives on between rounds, as in a
long-running engine), on the prompts of benchmarks/vllm_side_by_side.py (the shipped prompts a category
at a time in turn, chat template, greedy, 64 tokens each, EOS ignored), one request at a time (8
prompts) and 8 and 32 at once, alternated `--rounds` times; tokens/s end to end, the best of the
rounds, and a check that both give the same tokens; the mirror's memory beside the pool's, and the
process's minor page faults during each row (memory the allocator took from the system: the
mirror's growth, in its first round).

  python -m benchmarks.kv_mirror_ab --model /tmp/vllm/smollm2 [--ngram] \\
      [--max-tokens 256 --batches "8 at once,32 at once"] \\
      --out bench_results/kv_mirror_ab_plain_cpu.json
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from nanospec import LLM, SamplingParams
from nanospec.cli import set_threads
from nanospec.cuda_graph import StepOptions
from benchmarks.vllm_side_by_side import BATCHES, prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF folder or GGUF file (float32)")
    ap.add_argument("--ngram", action="store_true", help="n-gram K=4 instead of plain decoding")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default=",".join(BATCHES), help="rows of BATCHES to run")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_threads(2)
    proposer = {"ngram": True, "num_speculative_tokens": 4} if args.ngram else {}
    # one engine each, built once: the mirror's lives on between rounds, as in a long-running engine
    # (running the mirror's engine with the mirror off would drop it)
    llms = {mirror: LLM(args.model, device="cpu", dtype="float32", max_num_seqs=32,
                        step_options=StepOptions(kv_mirror=mirror), **proposer)
            for mirror in (True, False)}
    ids = prompt_ids(args.model)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():   # warm-up
        llm.generate(ids[:1], params)
    rows, tokens = [], {}
    for round_ in range(1, args.rounds + 1):
        for mirror, llm in llms.items():
            for batch in args.batches.split(","):
                count, at_once = BATCHES[batch]
                faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                outs = [o.token_ids for i in range(0, count,
                                                   at_once) for o in llm.generate(ids[i:i + at_once], params)]
                seconds = time.perf_counter() - start
                assert tokens.setdefault(batch, outs) == outs, f"the mirror changed the tokens at {batch}"
                held = llm.engine.kv_cache.mirror
                rows.append({"round": round_, "mirror": mirror, "batch": batch, "tokens": sum(map(len, outs)),
                             "seconds": round(seconds, 3),
                             "tokens_per_s": round(sum(map(len, outs)) / seconds, 2),
                             "mirror_mb": round(held.kv.nbytes / 2**20, 1) if held else 0,
                             "page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                             "pool_mb": round(llm.engine.kv_cache.pool.nbytes / 2**20, 1)})
                print(rows[-1], file=sys.stderr)
    best = {}
    for r in rows:
        key = (r["batch"], r["mirror"])
        best[key] = max(best.get(key, 0), r["tokens_per_s"])
    summary = [{"batch": b, "mirror": best[b, True], "reference": best[b, False],
                "ratio": round(best[b, True] / best[b, False], 3)} for b in args.batches.split(",")]
    report = {"command": "python -m benchmarks.kv_mirror_ab " + " ".join(sys.argv[1:]),
              "mode": "ngram" if args.ngram else "plain", "same_tokens": True, "best": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
