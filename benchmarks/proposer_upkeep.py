"""What a proposer costs where it drafts nothing: plain decoding against an engine whose model drafter is
held at K = 0 (an EAGLE head still keeps the target's features and absorbs them, a draft model catches up
at its next round), side by side on the same requests. Dynamic K pays this in every step it chooses K = 0.

Greedy, the shipped prompts in the chat template, every request writing --max-new-tokens tokens; the two
engines take turns a step at a time (each repeat starts with the other), and a repeat's ratio is the
held engine's tokens/s over plain's; both must emit the same tokens.

    python -m benchmarks.proposer_upkeep --eagle HEAD [--batch-size 8] [--repeats 3] \
        [--no-enable-prefix-caching] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys

from benchmarks.measure import run_and_report
from nanospec import LLM
from nanospec.cli import set_threads
from nanospec.dynamic_k import greedy_requests, timed, twin
from nanospec.errors import NanospecError, check_int
from nanospec.k_policy import StaticK
from nanospec.prompts import shipped_prompts


def side_by_side(plain: LLM, held: LLM, prompts: list[list[int]], batch: int, max_new_tokens: int,
                 held_first: bool) -> dict:
    """One repeat: each engine's seconds over its own decode and prefill steps, and whether they agree."""
    blocks = batch * plain.engine.kv_cache.allocator.blocks_for(max(map(len, prompts)) + max_new_tokens + 1)
    engines = {"plain": twin(plain.engine, blocks, max_num_seqs=batch),
               "held_at_k0": twin(held.engine, blocks, max_num_seqs=batch, k_policy=StaticK(0))}
    requests = {name: greedy_requests(engine, prompts, max_new_tokens) for name, engine in engines.items()}
    seconds = dict.fromkeys(engines, 0.0)
    order = list(engines)[::-1] if held_first else list(engines)
    while any(engine.scheduler.has_work() for engine in engines.values()):
        for name in order:
            if engines[name].scheduler.has_work():
                seconds[name] += timed(plain.device, engines[name].step)[1]
    same = [r.output_ids for r in requests["plain"]] == [r.output_ids for r in requests["held_at_k0"]]
    return {"seconds": {k: round(v, 3) for k, v in seconds.items()},
            "held_over_plain": round(seconds["plain"] / seconds["held_at_k0"], 4), "same_tokens": same,
            "held_drafted": engines["held_at_k0"].stats.drafted_tokens}


def run(args) -> dict:
    if not (args.eagle or args.draft):
        raise NanospecError("give the drafter to hold at K = 0: --eagle HEAD or --draft PATH")
    for value, name in ((args.batch_size, "--batch-size"), (args.repeats, "--repeats"),
                        (args.max_prompts, "--max-prompts"), (args.max_new_tokens, "--max-new-tokens")):
        check_int(value, name, low=1)
    set_threads(args.threads)
    settings = dict(device="cpu", dtype="float32", max_num_seqs=args.batch_size,
                    enable_prefix_caching=args.enable_prefix_caching)
    plain = LLM(args.target, **settings)
    held = LLM(args.target, eagle=args.eagle, draft=args.draft, **settings)
    prompts = [plain.encode_prompt(row["prompt"], chat=True) for row in shipped_prompts()[:args.max_prompts]]
    repeats = []
    for repeat in range(args.repeats):
        repeats.append(side_by_side(plain, held, prompts, args.batch_size, args.max_new_tokens,
                                    held_first=repeat % 2 == 1))
        print(f"repeat {repeat + 1}: {repeats[-1]}", file=sys.stderr, flush=True)
    return {"benchmark": "a model drafter held at K = 0 against plain decoding, greedy, side by side",
            "command": "python -m benchmarks.proposer_upkeep " + " ".join(sys.argv[1:]),
            "target": plain.target_name, "eagle": args.eagle, "draft": args.draft,
            "batch_size": args.batch_size, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "prefix_caching": args.enable_prefix_caching,
            "held_over_plain_median": statistics.median(r["held_over_plain"] for r in repeats),
            "repeats": repeats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="the target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--eagle", help="an EAGLE head to hold at K = 0")
    ap.add_argument("--draft", help="a draft model to hold at K = 0")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="prefix caching in both engines (with it, a finishing request's held-back features "
                         "are fed to an EAGLE head, so that a later turn finds its cache)")
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    return run_and_report(run, args)


if __name__ == "__main__":
    sys.exit(main())
