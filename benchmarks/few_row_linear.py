"""cpu_linear.Linear's two ways with 1-2 rows on this CPU, side by side in one process: MKL's W @ x.T (one row
padded to two) against oneDNN's packed copy of the weight (cpu_linear.FEW_ROWS_BY_MKL True and False). The
same LLM decodes the shipped prompts greedily at each batch size (1 and 2: every product of 1-2 rows;
plain decoding), the two ways alternated, --repeats times each; reports tokens/s, the median of the
per-repeat ratios, whether both decoded the same tokens, and the CPU's flags.

    python -m benchmarks.few_row_linear [--target PATH] [--batch-sizes 1,2] [--max-new-tokens 64]
        [--repeats 4] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.measure import cpu_flags
from nanospec import LLM, SamplingParams, cpu_linear
from nanospec.prompts import shipped_prompts

WAYS = {"mkl": True, "packed": False}   # FEW_ROWS_BY_MKL


def tokens_per_s(llm: LLM, prompts: list[str], max_new_tokens: int) -> tuple[float, list]:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), chat=True)   # warm: pack, cache
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True),
                        chat=True)
    return len(prompts) * max_new_tokens / (time.perf_counter() - start), [o.token_ids for o in outs]


def measure(llm: LLM, batch: int, args) -> dict:
    prompts = [p["prompt"] for p in shipped_prompts()][:batch]
    rates, tokens = {way: [] for way in WAYS}, {}
    for repeat in range(args.repeats):
        for way in (list(WAYS) if repeat % 2 == 0 else list(WAYS)[::-1]):
            cpu_linear.FEW_ROWS_BY_MKL = WAYS[way]
            rate, tokens[way] = tokens_per_s(llm, prompts, args.max_new_tokens)
            rates[way].append(round(rate, 2))
    ratio = statistics.median(p / m for p, m in zip(rates["packed"], rates["mkl"]))
    print(f"batch {batch}: packed / mkl {ratio:.3f} ({rates})", file=sys.stderr)
    return {"batch_size": batch, "tokens_per_s": rates, "packed_over_mkl": round(ratio, 3),
            "same_tokens": tokens["packed"] == tokens["mkl"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    default = cpu_linear.FEW_ROWS_BY_MKL
    llm = LLM(args.target, device="cpu", dtype="float32", kv_cache_gb=0.3,
              max_num_seqs=max(map(int, args.batch_sizes.split(","))))
    try:
        rows = [measure(llm, int(b), args) for b in args.batch_sizes.split(",")]
    finally:
        cpu_linear.FEW_ROWS_BY_MKL = default
    command = "python -m benchmarks.few_row_linear " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command,
              "cpu_flags": cpu_flags(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "default_few_rows_by_mkl": default,
              "results": rows}
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
