"""float32 against bfloat16 on this CPU, side by side in one process: plain decoding tokens/s of the
shipped prompts (chat, greedy, ignore_eos) at each batch size, and the seconds of an EAGLE-1 training
step (train_eagle.py's default recipe, a few steps; --no-train skips it). Where the CPU multiplies
bfloat16 natively (AVX-512 BF16), a third row runs bfloat16 through torch's F.linear, the projections'
path before cpu_linear took the packed copy for it. The ways take turns, --repeats times; medians, the
CPU's flags.

    python -m benchmarks.cpu_dtype [--target PATH] [--batch-sizes 1,8] [--max-new-tokens 48]
        [--repeats 3] [--no-train] [--out bench_results/cpu_dtype.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

import train_eagle
from benchmarks.measure import cpu_flags
from nanospec import LLM, SamplingParams, cpu_linear
from nanospec.prompts import shipped_prompts


def decode_rate(llm: LLM, prompts: list[str], batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start, n = time.perf_counter(), 0
    for first in range(0, len(prompts), batch):
        n += sum(len(o.token_ids) for o in llm.generate(prompts[first:first + batch], params, chat=True))
    return n / (time.perf_counter() - start)


def train_step_seconds(dtype: str, steps: int = 12) -> float:
    with tempfile.TemporaryDirectory() as out:
        report = train_eagle.run(train_eagle.parse_args(
            ["--out", out, "--num-prompts", "16", "--steps", str(steps), "--warmup", "2", "--no-eval",
             "--device", "cpu", "--dtype", dtype]))
    return report["training"]["seconds_this_run"] / steps


def ways() -> dict[str, tuple[str, tuple]]:
    """Each way's dtype and the projections' fast dtypes (cpu_linear.FAST_DTYPES) while it runs."""
    out = {"float32": ("float32", cpu_linear.FAST_DTYPES), "bfloat16": ("bfloat16", cpu_linear.FAST_DTYPES)}
    if torch.bfloat16 in cpu_linear.FAST_DTYPES:
        out["bfloat16, F.linear"] = ("bfloat16", (torch.float32,))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-train", action="store_true", help="decoding only")
    ap.add_argument("--out", default="bench_results/cpu_dtype.json")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [p["prompt"] for p in shipped_prompts()][:max(batches)]
    llms = {d: LLM(args.target, device="cpu", dtype=d, kv_cache_gb=0.3, max_num_seqs=max(batches))
            for d in ("float32", "bfloat16")}
    fast, rates, taken = cpu_linear.FAST_DTYPES, {}, ways()
    try:
        for repeat in range(args.repeats):   # the ways take turns, so that load on the machine hits each
            for name, (dtype, fast_dtypes) in taken.items():
                cpu_linear.FAST_DTYPES = fast_dtypes
                for b in batches:
                    rate = decode_rate(llms[dtype], prompts, b, args.max_new_tokens)
                    rates.setdefault(f"{name}, batch {b}", []).append(round(rate, 2))
    finally:
        cpu_linear.FAST_DTYPES = fast
    train = {} if args.no_train else {d: [round(train_step_seconds(d), 3) for _ in range(args.repeats)]
                                      for d in llms}
    result = {"command": "python -m benchmarks.cpu_dtype " + " ".join(sys.argv[1:] if argv is None else argv),
              "cpu_flags": cpu_flags(), "native_bfloat16": cpu_linear.NATIVE_BF16, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens,
              "plain_tokens_per_second": rates,
              "median_tokens_per_second": {k: round(statistics.median(v), 2) for k, v in rates.items()},
              "train_step_seconds": train}
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
