"""How well a model drafter's own confidence foretells acceptance, and what its round costs in a step.

A static-K engine (an EAGLE head or a draft model, greedy chains) decodes the shipped prompts in the
chat template at --batch-size. Every draft d_i gets its path confidence, the product of the drafter's
probabilities of d_1 .. d_i (each the softmax's largest: greedy drafts), and counts in the bin of that
confidence (tenths) at its position: drafted, and accepted by the target. Each step is split into
the drafter's round, the verification and the rest (ms, medians), beside the step of an engine that
holds the drafter at K = 0 on the same requests. A confidence-placed budget for
model drafters would calibrate on the first (docs/dynamic_k.md); the second says what it could save.

    python -m benchmarks.draft_confidence --eagle HEAD [--speculative-token-map MAP] [--draft PATH]
        [--k 2] [--batch-size 8] [--max-prompts 32] [--max-new-tokens 96] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.measure import cpu_flags, run_and_report
from nanospec import LLM, SamplingParams
from nanospec.cli import set_threads
from nanospec.dynamic_k import twin
from nanospec.errors import NanospecError, check_int
from nanospec.k_policy import StaticK
from nanospec.prompts import by_category_in_turn, shipped_prompts


def spy(engine, confidences: list, seconds: dict) -> None:
    """Wrap the engine's drafter steps (each draft step's largest probability per row, in
    `confidences`) and the step's parts (their seconds, in `seconds`)."""
    proposer, steps, inside = engine.proposer, engine.step_graphs, []

    def largest(logits: torch.Tensor) -> list[float]:
        return torch.softmax(logits.float(), -1).amax(-1).tolist()

    def outermost(real, *args):   # a draft model's first_step and next_step call its catch_up_step
        inside.append(1)
        try:
            return real(*args)
        finally:
            inside.pop()

    def first(real):   # the round's first step: its rows (a draft model's graphed catch-up: every row)
        def call(meta, *args):
            if inside:
                return real(meta, *args)
            logits = outermost(real, meta, *args)
            rows = args[1].tolist() if real.__name__ == "first_step" else range(len(logits))
            confidences[:] = [dict(zip(rows, largest(logits)))]
            return logits
        return call

    def next_step(meta, input_ids, hidden):
        logits, hidden = outermost(real_next, meta, input_ids, hidden)
        confidences.append(dict(enumerate(largest(logits))))
        return logits, hidden

    real_next = proposer.next_step
    proposer.first_step, proposer.next_step = first(proposer.first_step), next_step
    if hasattr(proposer, "catch_up_step"):
        proposer.catch_up_step = first(proposer.catch_up_step)
    for obj, name in ((steps, "run_round"), (steps, "run"), (engine, "step")):
        def timed(*args, _real=getattr(obj, name), _name=name):
            start = time.perf_counter()
            out = _real(*args)
            seconds.setdefault(_name, []).append(time.perf_counter() - start)
            return out
        setattr(obj, name, timed)


def run(args) -> dict:
    if not (args.eagle or args.draft):
        raise NanospecError("give the drafter: --eagle HEAD or --draft PATH")
    for value, name in ((args.k, "--k"), (args.batch_size, "--batch-size"),
                        (args.max_prompts, "--max-prompts"), (args.max_new_tokens, "--max-new-tokens")):
        check_int(value, name, low=1)
    set_threads(args.threads)
    llm = LLM(args.target, device="cpu", dtype="float32", max_num_seqs=args.batch_size, eagle=args.eagle,
              draft=args.draft, speculative_token_map=args.speculative_token_map,
              num_speculative_tokens=args.k)
    rows = by_category_in_turn(shipped_prompts())[:args.max_prompts]
    engine = twin(llm.engine, k_policy=StaticK(args.k), max_num_seqs=args.batch_size)
    confidences, seconds = [], {}
    spy(engine, confidences, seconds)
    counts = {}   # (position, bin) -> [drafted, accepted]
    real_account = engine.account

    def account(reqs, ks, num_draft, accepted, *rest, **kw):
        for b, (d, a) in enumerate(zip(num_draft, accepted)):
            path = 1.0
            for i in range(min(d, len(confidences))):   # (a row outside the round drafted nothing)
                path *= confidences[i].get(b, 0.0)
                cell = counts.setdefault((i + 1, min(int(path * 10), 9)), [0, 0])
                cell[0], cell[1] = cell[0] + 1, cell[1] + (a > i)
        confidences.clear()
        return real_account(reqs, ks, num_draft, accepted, *rest, **kw)
    engine.account = account
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    prompts = [llm.encode_prompt(row["prompt"], chat=True) for row in rows]
    held, held_seconds = twin(llm.engine, k_policy=StaticK(0), max_num_seqs=args.batch_size), {}
    spy(held, [], held_seconds)   # the same requests at K = 0 (the drafter held): the step beside
    for e in (engine, held):
        e.add_requests([e.new_request(i, row["prompt"], ids, params)
                        for i, (row, ids) in enumerate(zip(rows, prompts))])
        e.run_to_completion()
    median_ms = lambda name, of=seconds: of.get(name) and round(statistics.median(of[name]) * 1000, 2)
    return {"benchmark": "a model drafter's confidence against acceptance, greedy chains at a static K",
            "command": "python -m benchmarks.draft_confidence " + " ".join(sys.argv[1:]),
            "target": llm.target_name, "eagle": args.eagle, "draft": args.draft,
            "speculative_token_map": args.speculative_token_map, "k": args.k, "batch_size": args.batch_size,
            "prompts": len(rows), "max_new_tokens": args.max_new_tokens, "cpu_flags": cpu_flags(),
            "drafted_tokens": engine.stats.drafted_tokens, "accepted_tokens": engine.stats.accepted_tokens,
            "by_position_and_confidence": [
                {"position": i, "confidence": f"{b / 10:.1f}-{(b + 1) / 10:.1f}", "drafted": n, "accepted": a,
                 "acceptance": round(a / n, 3)} for (i, b), (n, a) in sorted(counts.items())],
            "step_ms_median": {"step": median_ms("step"), "round": median_ms("run_round"),
                               "verify": median_ms("run"), "k0_step": median_ms("step", held_seconds),
                               "k0_verify": median_ms("run", held_seconds)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="the target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--eagle", help="an EAGLE head")
    ap.add_argument("--draft", help="a draft model")
    ap.add_argument("--speculative-token-map", help="the EAGLE-1 head's token map")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", metavar="FILE.json")
    args = ap.parse_args(argv)
    return run_and_report(run, args)


if __name__ == "__main__":
    sys.exit(main())
