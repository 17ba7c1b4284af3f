"""Greedy tokens/s of plain decoding with SmolLM2 (the offline GGUF) at one batch size, for the
nanospec package found at ROOT: run it for two checkouts in turn to compare them side by side.

    git worktree add /tmp/before COMMIT
    for b in 1 9 16; do for root in /tmp/before .; do python -m benchmarks.tokens_per_s $root $b; done; done
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="a checkout of nanospec (its package is imported from there)")
    ap.add_argument("batch", type=int, help="requests, all queued at once")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default: 48)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    ap.add_argument("--pad", action="store_true",
                    help="pad each batch to the CUDA graphs' buckets (StepOptions.pad_batches), as the tests "
                         "do")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    sys.path.insert(0, root)
    import torch
    torch.set_num_threads(args.threads)
    import nanospec
    from nanospec import LLM, SamplingParams
    from nanospec.prompts import shipped_prompts
    assert nanospec.__file__.startswith(root), f"imported {nanospec.__file__}, not the one in {root}"
    from nanospec import cuda_graph
    options = {}
    if args.pad and hasattr(cuda_graph, "StepOptions"):
        options["step_options"] = cuda_graph.StepOptions(pad_batches=True)
    elif args.pad:   # a checkout from before StepOptions: its module switch
        cuda_graph.PAD_EAGER_BATCHES = True
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=args.batch, **options)
    prompts = [r["prompt"] for r in shipped_prompts()][:args.batch]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))   # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start
    print(json.dumps({"root": args.root, "batch": args.batch, "pad": args.pad,
                      "tokens_per_s": round(sum(len(o.token_ids) for o in outs) / seconds, 2)}))


if __name__ == "__main__":
    main()
