"""Where a CPU decode step's time goes: SmolLM2's plain greedy decode steps at batch 1, 8 and 32
(prompts cycled from the shipped ones, past prefill), timed whole and in three parts: the
projections (cpu_linear.Linear, lm_head included), the attention (kv_mirror.paged_attention: the K/V
kept gathered from the last pass, the pages it copies in from the pool, and SDPA; the copies split
apart), and the rest (norms, rotation, K/V writes, SiLU, metadata, sampling, Python). Each part is timed by
wrapping its function with a wall clock, so the parts include what a call costs from Python; the step is the
median of --steps, the parts their mean. Also the share of the keys the attention reads that are padding (each
sequence's pages padded to the batch's longest, masked).

With --model random:smollm2-hollow (SmolLM2's 30 layers, heads and vocabulary, its widths cut
8-fold: 21 MB of weights, which stay in cache) the same steps read almost no weights: what a step
costs beyond its weights' traffic. The prompts are SmolLM2's token ids whatever the model.

    python -m benchmarks.step_split [--model TARGET] [--batch-sizes 1,8,32] [--steps 20] [--no-kv-mirror]
    [--out FILE.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.measure import clocked, decoding
from nanospec import LLM, cpu_linear, gguf_file, model
from nanospec.checkpoint import default_model_path
from nanospec.cuda_graph import StepOptions
from nanospec.cli import set_threads
from nanospec.dynamic_k import twin
from nanospec.prompts import shipped_prompts
from nanospec.tokenizer import load_tokenizer


def timed_parts(totals: Counter):
    """Wrap Linear.forward, the attention and its copies from the pool with clocks adding into totals;
    returns undo."""
    linear, attention, select = cpu_linear.Linear.forward, model.paged_attention, torch.Tensor.index_select

    clock = functools.partial(clocked, totals)
    timed_attention = clock("attention", attention)

    # the keys read, and those that are padding
    def counted_attention(q, k, v, kv_cache, layer, meta, scale):
        totals["keys read"] += meta.block_tables.numel() * kv_cache.block_size
        totals["keys"] += int(meta.context_lens.sum())
        return timed_attention(q, k, v, kv_cache, layer, meta, scale)
    cpu_linear.Linear.forward = clock("projections", linear)
    model.paged_attention = counted_attention
    # in a step, only the attention calls index_select: the pages it copies in from the pool
    torch.Tensor.index_select = clock("attention: K/V copied from the pool", select)
    return lambda: (setattr(cpu_linear.Linear, "forward", linear),
                    setattr(model, "paged_attention", attention), delattr(torch.Tensor, "index_select"))


def split(llm: LLM, prompts: list[list[int]], batch: int, steps: int) -> dict:
    engine = twin(llm.engine, batch * 24, max_num_seqs=batch)
    decoding(engine, [prompts[i % len(prompts)] for i in range(batch)], steps + 8)
    for _ in range(2):
        engine.step()
    totals, seconds = Counter(), []
    undo = timed_parts(totals)
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - start)
    finally:
        undo()
    padding = 1 - totals.pop("keys") / totals.pop("keys read")
    ms = {name: round(1e3 * total / steps, 2) for name, total in totals.items()}
    step = 1e3 * statistics.median(seconds)
    return {"batch_size": batch, "step_ms": round(step, 2), **{f"{k}_ms": v for k, v in ms.items()},
            "rest_ms": round(1e3 * sum(seconds) / steps - ms["projections"] - ms["attention"], 2),
            "keys_read_padding": round(padding, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the target (default: the offline SmolLM2), e.g. random:smollm2-hollow")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-kv-mirror", action="store_true",
                    help="the reference attention's gather in every layer")
    ap.add_argument("--out")
    args = ap.parse_args()
    set_threads(None)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, device="cpu", dtype="float32", max_num_seqs=max(batches),
              step_options=StepOptions(kv_mirror=not args.no_kv_mirror))
    smollm2 = default_model_path()
    tokenizer = load_tokenizer(smollm2, gguf_file.metadata(gguf_file.open_reader(smollm2)))
    prompts = [tokenizer.apply_chat_template([{"role": "user",
                                               "content": row["prompt"]}]) for row in shipped_prompts()]
    rows = []
    for batch in batches:
        rows.append(split(llm, prompts, batch, args.steps))
        print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.step_split " + " ".join(sys.argv[1:]),
                       "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
