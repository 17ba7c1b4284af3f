"""float32 against bfloat16 on this CPU, side by side: plain decoding tokens/s of the default model
(batch 1 and 8) and the seconds of an EAGLE-1 training step (train_eagle.py's default recipe, a few
steps). Writes bench_results/cpu_dtype.json. Usage: python -m benchmarks.cpu_dtype [--repeats N]"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

import train_eagle
from nanospec import LLM, SamplingParams

PROMPTS = ["Write a haiku about the sea.", "Explain photosynthesis in two sentences.",
           "List three uses of Python.", "What is the capital of France?", "Describe a cat.",
           "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Hamlet."]


def decode_rate(llm: LLM, batch: int, tokens: int = 48) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start, n = time.perf_counter(), 0
    for first in range(0, len(PROMPTS), batch):
        outs = llm.generate(PROMPTS[first:first + batch], params, chat=True)
        n += sum(len(o.token_ids) for o in outs)
    return n / (time.perf_counter() - start)


def train_step_seconds(dtype: str, steps: int = 12) -> float:
    with tempfile.TemporaryDirectory() as out:
        report = train_eagle.run(train_eagle.parse_args(
            ["--out", out, "--num-prompts", "16", "--steps", str(steps), "--warmup", "2", "--no-eval",
             "--device", "cpu", "--dtype", dtype]))
    return report["training"]["seconds_this_run"] / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    llms = {d: LLM(device="cpu", dtype=d) for d in ("float32", "bfloat16")}
    rows = {f"{d} batch {b}": [] for d in llms for b in (1, 8)}
    for _ in range(args.repeats):   # the dtypes take turns, so that load on the machine hits both
        for d, llm in llms.items():
            for b in (1, 8):
                rows[f"{d} batch {b}"].append(round(decode_rate(llm, b), 2))
    train = {d: [] for d in llms}
    for _ in range(args.repeats):
        for d in llms:
            train[d].append(round(train_step_seconds(d), 3))
    result = {"command": "python -m benchmarks.cpu_dtype " + " ".join(sys.argv[1:]),
              "cpu": platform.processor() or platform.machine(),
              "native_bfloat16": train_eagle.native_bfloat16(), "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "plain_tokens_per_second": rows, "train_step_seconds": train}
    print(json.dumps(result, indent=2))
    os.makedirs("bench_results", exist_ok=True)
    with open("bench_results/cpu_dtype.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
