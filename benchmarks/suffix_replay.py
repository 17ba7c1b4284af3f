"""Replay: suffix decoding's draft-length rules against n-gram on a recorded greedy workload, exactly
and in seconds, without a machine's noise.

Greedy decoding is deterministic and host drafts depend only on the tokens so far (and, for suffix
decoding, on the requests finished before), so one greedy run of a workload fixes every request's
tokens; any drafting rule can then be stepped through as the engine steps a batch of one: draft
from the context, accept the draft's longest prefix that the recorded output continues with, move
past it and the bonus token. The acceptance lengths are the engine's own (the replay of the
benchmark's rows gives its figures to the third decimal). Only the clock is a model: a step that
verifies d drafts takes 1 + c * d, c the cost of verifying a draft in steps of plain decoding
(on this CPU about 0.03 at batch 1 and 0.27 at batch 8: fitted on the proposers benchmark's rows,
docs/suffix_decoding.md). Rows:

  ngram           prompt lookup at K = 4
  suffix+N        suffix decoding (K 16) with N extra tokens always drafted (N = 0: vLLM's rule)
  suffix+N priced the same with the extra tokens priced (suffix.ExtraTokens), fed the model's step times
  suffix+N@pP     with min_token_prob P (a draft stops where its path's probability falls below P)
  suffix+N@mM     drafting only from matches of M tokens or more (the request's own stream: 1, the
                  global index: 2, by default); @pP@mM both. Whether gating weak drafts pays where
                  verifying is dear: docs/suffix_decoding.md, "Gating weak drafts"
  arctic          ArcticInference's suffix decoding (the implementation vLLM's method "suffix" imports),
                  fed as vLLM's proposer feeds it (each row's first draft comes from the prompt alone,
                  where vLLM's waits for the first sampled token), at K 16 and its defaults (vLLM's
                  rule, as suffix+0):
                  the program that defines the method, as an oracle of what nanospec's index finds;
                  needs arctic_inference importable (README, "Multi-turn sessions through the server")

    python -m benchmarks.suffix_replay --workload multiturn --costs 0.03,0.27 [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
import unittest.mock
from types import SimpleNamespace

from benchmarks.proposers import run_rows
from nanospec.bench_serve import multiturn_sessions
from nanospec.cli import set_threads
from nanospec.llm import LLM
from nanospec.prompts import by_category_in_turn, shipped_prompts
from nanospec.proposer import NgramIndex
from nanospec import suffix as suffix_module
from nanospec.suffix import MIN_TOKEN_PROB, SuffixProposer


def record(workload: str, max_prompts: int, max_new_tokens: int) -> list[dict]:
    """The workload's requests, greedy, in the order they finish at batch 1 (n-gram's engine: the
    same tokens as plain decoding, sooner)."""
    rows = by_category_in_turn(shipped_prompts())
    rows = rows[:max_prompts] if max_prompts else rows
    turns = 3 if workload == "multiturn" else 1
    llm = LLM(device="cpu", dtype="float32", ngram=True, max_num_seqs=1)
    state = run_rows({"ngram": llm}, ["ngram"], lambda: multiturn_sessions(rows, turns), 1, max_new_tokens,
                     min(llm.max_model_len, 4096))
    return [dict(category=c, prompt=r.prompt_ids, output=r.output_ids) for c, r in state["ngram"]["done"]]


def min_match_at_least(m: int):
    """A context in which every suffix match shorter than m tokens drafts nothing."""
    real = suffix_module.best_draft
    return unittest.mock.patch.object(suffix_module, "best_draft", lambda before, after, context, k,
                                      min_match, **kw:
                                      real(before, after, context, k, max(min_match, m), **kw))


def replay(trace: list[dict], rule: str, cost: float) -> dict:
    """One row: the rule stepped through every request in order (finished ones feed suffix's index)."""
    rule_name, *options = rule.split("@")
    options = {o[0]: float(o[1:]) for o in options}   # p: min_token_prob, m: min match
    with min_match_at_least(int(options.get("m", 1))):
        return replay_rule(trace, rule, rule_name, cost, options.get("p", MIN_TOKEN_PROB))


class ArcticDrafter:
    """ArcticInference's SuffixDecodingCache as vLLM's SuffixDecodingProposer drives it: a request's
    prompt tree started with its prompt, its new tokens added before each draft, the draft taken from
    the last max_tree_depth tokens; a finished request's response stays in the global tree."""

    def __init__(self, min_token_prob: float):
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            sys.exit("suffix_replay: the arctic row needs ArcticInference: install arctic-inference (README, "
                     "'Multi-turn sessions through the server', builds it) or leave the row out")
        self.cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)
        self.min_token_prob = min_token_prob
        self.fed = {}   # request id -> tokens the cache holds of it

    def draft(self, rid: int, prompt: list[int], tokens: list[int], k: int) -> list[int]:
        self.feed(rid, prompt, tokens)
        return self.cache.speculate(rid, tokens[-24:], max_spec_tokens=k, max_spec_factor=1.0,
                                    min_token_prob=self.min_token_prob).token_ids

    def feed(self, rid: int, prompt: list[int], tokens: list[int]) -> None:
        if rid not in self.fed:
            self.cache.start_request(rid, prompt)
            self.fed[rid] = len(prompt)
        if len(tokens) > self.fed[rid]:
            self.cache.add_active_response(rid, tokens[self.fed[rid]:])
            self.fed[rid] = len(tokens)

    def finished(self, rid: int, prompt: list[int], tokens: list[int]) -> None:
        self.feed(rid, prompt, tokens)
        self.cache.stop_request(rid)


def replay_rule(trace: list[dict], rule: str, rule_name: str, cost: float, min_token_prob: float) -> dict:
    name, _, offset = rule_name.partition("+")
    priced = offset.endswith(" priced")
    suffix = SuffixProposer("cpu", max_spec_offset=int(offset.split()[0] or 0),
                            min_token_prob=min_token_prob) if name == "suffix" else None
    arctic = ArcticDrafter(min_token_prob) if name == "arctic" else None
    per_category = defaultdict(lambda: [0, 0])
    steps = drafted = 0
    clock = 0.0
    for rid, t in enumerate(trace):
        tokens, pos = t["prompt"] + t["output"], len(t["prompt"])
        request, ngram = SimpleNamespace(tokens=[], suffix_stream=None), NgramIndex(1, 4)
        while pos < len(tokens):
            request.tokens = tokens[:pos]
            if arctic is not None:
                draft = arctic.draft(rid, t["prompt"], request.tokens, 16)
            elif suffix is None:
                draft = ngram.lookup(request.tokens, 4)
            else:
                draft = (suffix.propose([request], [16]).host_drafts[0] if priced
                         else suffix.drafts([request], [16])[0].tokens)
            accepted = 0
            while (accepted < len(draft) and pos + accepted < len(tokens)
                   and draft[accepted] == tokens[pos + accepted]):
                accepted += 1
            if priced:
                suffix.verified([len(draft)], [accepted], 1 + cost * len(draft))
            per_category[t["category"]][1] += 1
            steps, drafted = steps + 1, drafted + len(draft)
            clock, pos = clock + 1 + cost * len(draft), pos + accepted + 1
        per_category[t["category"]][0] += len(t["output"])
        if suffix is not None:
            request.tokens = tokens
            suffix.finished(request)
        if arctic is not None:
            arctic.finished(rid, t["prompt"], tokens)
    generated = sum(n for n, _ in per_category.values())
    return {"row": rule, "cost": cost, "mean_acceptance_length": round(generated / steps, 3),
            "drafted_per_step": round(drafted / steps, 3),
            "tokens_per_plain_step": round(generated / clock, 4),
            "acceptance_length_per_category": {c: round(n / s, 3) for c,
                                               (n, s) in sorted(per_category.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["shipped", "multiturn"], default="multiturn")
    ap.add_argument("--max-prompts", type=int, default=None,
                    help="first N shipped prompts, in turn by category "
                    "(default: all for shipped, 16 sessions for multiturn, as the benchmark's runs)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--costs", default="0.03,0.27", help="verifying a draft, in steps of plain decoding")
    ap.add_argument("--rows", default="ngram,suffix+0,suffix+3,suffix+3 priced")
    ap.add_argument("--out", help="write the rows as JSON there")
    args = ap.parse_args()
    set_threads(None)
    max_prompts = args.max_prompts or (16 if args.workload == "multiturn" else None)
    trace = record(args.workload, max_prompts, args.max_new_tokens)
    rows = [replay(trace, rule, float(c)) for c in args.costs.split(",") for rule in args.rows.split(",")]
    for r in rows:
        per = " ".join(f"{c[:9]} {v:.2f}" for c, v in r["acceptance_length_per_category"].items())
        print(f"c {r['cost']:<5} {r['row']:>16}  AL {r['mean_acceptance_length']:.3f}  drafted "
              f"{r['drafted_per_step']:.2f}  tokens/step {r['tokens_per_plain_step']:.3f}  {per}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.suffix_replay " + " ".join(sys.argv[1:]),
                       "workload": args.workload, "requests": len(trace), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
