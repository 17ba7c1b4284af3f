"""Offline tokens/s of two checkouts of nanospec in one process, their rows alternated: the package
before a change (imported from BEFORE under the name nanospec_before) against the one this runs from.
Both decode the same prompts greedily, so their tokens must be the same; the table gives each row's
median tokens/s and the median of the rounds' ratios (after / before).

    git worktree add /tmp/before COMMIT
    python -m benchmarks.before_after /tmp/before --rounds 3 --out FILE.json
    [--rows plain:1,ngram:8,tree:1,tree:8 --eagle HEAD]

Rows are PROPOSER:BATCH: plain, ngram (K = 4), tree (an EAGLE head's EAGLE-2 trees of 6 nodes, 3 x 3,
with HEAD/token_map.pt where there is one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

ROWS = [("plain", 1), ("plain", 8), ("ngram", 1), ("ngram", 8)]   # (proposer, batch)


def import_before(root: str):
    """The package at root/nanospec, copied under the name nanospec_before (its own imports renamed)."""
    folder = tempfile.mkdtemp(prefix="nanospec_before_")
    target = os.path.join(folder, "nanospec_before")
    shutil.copytree(os.path.join(root, "nanospec"), target)
    for dirpath, _, files in os.walk(target):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    src = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\bnanospec\b(?=[. ])", "nanospec_before", src))
    sys.path.insert(0, folder)
    import nanospec_before
    return nanospec_before


def build(package, proposer: str, batch: int, eagle: str | None = None):
    settings = {"plain": {}, "ngram": dict(ngram=True, num_speculative_tokens=4),
                "tree": dict(eagle=eagle, num_speculative_tokens=6, speculative_topk=3,
                             speculative_num_steps=3)}[proposer]
    if proposer == "tree" and os.path.exists(os.path.join(eagle, "token_map.pt")):
        settings["speculative_token_map"] = os.path.join(eagle, "token_map.pt")
    return package.LLM(device="cpu", dtype="float32", max_num_seqs=batch, **settings)


def run(llm, package, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = package.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="a checkout of nanospec from before the change")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--rows", default=",".join(f"{p}:{b}" for p, b in ROWS), help="PROPOSER:BATCH, ...")
    ap.add_argument("--eagle", help="an EAGLE head, for tree rows")
    args = ap.parse_args()
    rows = [(p, int(b)) for p, b in (row.split(":") for row in args.rows.split(","))]
    if any(p == "tree" for p, _ in rows) and not args.eagle:
        sys.exit("tree rows need --eagle HEAD")
    import torch
    torch.set_num_threads(2)
    import nanospec as after
    from nanospec.prompts import shipped_prompts
    before = import_before(os.path.abspath(args.before))
    prompts = [r["prompt"] for r in shipped_prompts()]
    table = []
    for proposer, batch in rows:
        engines = {"before": (build(before, proposer, batch, args.eagle), before),
                   "after": (build(after, proposer, batch, args.eagle), after)}
        for llm, package in engines.values():
            run(llm, package, prompts[:1], 4)   # warm-up
        rates, ratios, tokens = {"before": [], "after": []}, [], {}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for name in order:
                rate, tokens[name] = run(*engines[name], prompts[:batch], args.max_tokens)
                rates[name].append(rate)
            ratios.append(rates["after"][-1] / rates["before"][-1])
        row = {"proposer": proposer, "batch": batch, "same_tokens": tokens["before"] == tokens["after"],
               "before_tokens_per_s": round(statistics.median(rates["before"]), 2),
               "after_tokens_per_s": round(statistics.median(rates["after"]), 2),
               "median_ratio": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}
        table.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "torch": torch.__version__, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
