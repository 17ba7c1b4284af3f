"""What a draft tree costs on this machine, SmolLM2 greedy, past prefill:

  verify  a decode step verifying a tree of N nodes against one verifying a chain of N as a chain
          (random drafts from a fixed-shape host proposer: both compute N + 1 queries a row): two
          engines stepped in turn, --steps each, medians; the tree is the static one of --tree-shape
          grown breadth first (a node's children before its grandchildren), cut to N nodes;
  host    a step of suffix decoding's trees (--speculative-topk 3, K 8) at batch 1, 64 and 256: the
          step whole, and its tree work on the host: drafting the trees (SuffixProposer.propose) and
          moving the accepted paths' K/V in place (tree.follow_paths), as a share of the step.

    python -m benchmarks.tree_costs [--nodes 4,8,16] [--batch-sizes 1,8] [--host-batch-sizes 1,64,256]
    [--steps 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections import Counter

import torch

from benchmarks.measure import clocked, decoding
from nanospec import LLM, engine as engine_module, gguf_file
from nanospec.checkpoint import default_model_path
from nanospec.cli import set_threads
from nanospec.dynamic_k import twin
from nanospec.k_policy import StaticK
from nanospec.prompts import shipped_prompts
from nanospec.proposer import Proposal, Proposer
from nanospec.suffix import SuffixProposer
from nanospec.tokenizer import load_tokenizer
from nanospec.tree import depths


def breadth_first_tree(nodes: int, branches: int) -> list[int]:
    """The parent list of a tree of `nodes` nodes, each with `branches` children, filled breadth first."""
    return [-1] + [(i - 1) // branches for i in range(1, nodes + 1)]


class ShapeProposer(Proposer):
    """Random drafts in one fixed shape for every request: a tree's parent list over [last token,
    drafts], or N for a chain of N (a chain step: no tree mask)."""
    drafts_on_host = True

    def __init__(self, shape: list[int] | int, vocab: int, seed: int = 0):
        self.shape, self.vocab, self.rng = shape, vocab, random.Random(seed)

    def propose(self, requests, ks) -> Proposal:
        tree = isinstance(self.shape, list)
        most = len(self.shape) - 1 if tree else self.shape
        ns = [min(most, k) for k in ks]   # (breadth first: any first n nodes are a tree)
        drafts = [[self.rng.randrange(self.vocab) for _ in range(n)] for n in ns]
        return Proposal(ns, drafts, parents=[self.shape[:n + 1] for n in ns] if tree else None)


def engine_for(llm: LLM, proposer, batch: int, longest: int, k: int):
    """A twin of the LLM's engine for `batch` requests of up to `longest` tokens, with `proposer` at K = k."""
    allocator = llm.engine.kv_cache.allocator
    return twin(llm.engine, batch * allocator.blocks_for(longest), max_num_seqs=batch, k_policy=StaticK(k),
                           proposer=proposer)


def verify_costs(llm: LLM, prompts, nodes: int, batch: int, steps: int, branches: int) -> dict:
    shapes = {"chain": nodes, "tree": breadth_first_tree(nodes, branches)}
    longest = max(len(p) for p in prompts) + steps + 16
    engines = {name: engine_for(llm, ShapeProposer(parents, llm.vocab_size), batch, longest, nodes)
               for name, parents in shapes.items()}
    for engine in engines.values():
        decoding(engine, [prompts[i % len(prompts)] for i in range(batch)], steps + 12)
    seconds = {name: [] for name in engines}
    for i in range(steps):
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):   # in turn, reversed each step
            start = time.perf_counter()
            engines[name].step()
            seconds[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
    return {"nodes": nodes, "batch_size": batch, "chain_step_ms": round(ms["chain"], 2),
            "tree_step_ms": round(ms["tree"], 2), "tree_over_chain": round(ms["tree"] / ms["chain"], 3),
            "tree_depth": max(depths(shapes["tree"]))}


def host_costs(llm: LLM, prompts, batch: int, steps: int) -> dict:
    """Suffix trees at `batch`: the step, drafting and the paths' moves, each a median per step."""
    longest = max(len(p) for p in prompts) + steps + 40
    engine = engine_for(llm, SuffixProposer(llm.device, branches=3), batch, longest, 8)
    decoding(engine, [prompts[i % len(prompts)] for i in range(batch)], steps + 30)
    totals, per_step = Counter(), {"step": [], "drafting": [], "paths": []}
    propose, follow = engine.proposer.propose, engine_module.follow_paths

    engine.proposer.propose = clocked(totals, "drafting", propose)
    engine_module.follow_paths = clocked(totals, "paths", follow)
    try:
        for _ in range(steps):
            totals.clear()
            start = time.perf_counter()
            engine.step()
            per_step["step"].append(time.perf_counter() - start)
            per_step["drafting"].append(totals["drafting"])
            per_step["paths"].append(totals["paths"])
    finally:
        engine_module.follow_paths = follow
    ms = {name: 1e3 * statistics.median(s) for name, s in per_step.items()}
    return {"batch_size": batch, "step_ms": round(ms["step"], 2), "drafting_ms": round(ms["drafting"], 3),
            "paths_ms": round(ms["paths"], 3),
            "tree_host_share": round((ms["drafting"] + ms["paths"]) / ms["step"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="4,8,16")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--host-batch-sizes", default="1,64,256")
    ap.add_argument("--branches", type=int, default=2, help="children a node of the verified tree has")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    set_threads(None)
    host_batches = [int(b) for b in args.host_batch_sizes.split(",") if b]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(None, device="cpu", dtype="float32", max_num_seqs=max(batches + host_batches), suffix=True,
              num_speculative_tokens=16, speculative_topk=3)
    smollm2 = default_model_path()
    tokenizer = load_tokenizer(smollm2, gguf_file.metadata(gguf_file.open_reader(smollm2)))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}])
               for row in shipped_prompts()]
    verify, host = [], []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for batch in batches:
            verify.append(verify_costs(llm, prompts, nodes, batch, args.steps, args.branches))
            print("verify", verify[-1], flush=True)
    for batch in host_batches:   # (prompts repeat past the shipped ones: their suffixes match)
        host.append(host_costs(llm, prompts, batch, max(4, args.steps // (1 + batch // 32))))
        print("host", host[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m benchmarks.tree_costs " + " ".join(sys.argv[1:]),
                       "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "verify": verify, "host": host}, f, indent=1)


if __name__ == "__main__":
    main()
