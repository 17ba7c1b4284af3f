"""Greedy outputs on the shipped prompts for plain decoding, n-gram, a draft model, EAGLE-1 / EAGLE-3
and dynamic K (one K per step and per request), and the dynamic-K replay's table, as one JSON file:
run it before and after a refactor and compare the two files (they must be identical).

    python tools/behaviour_snapshot.py --out /tmp/before.json [--eagle1 HEAD_FOLDER]
    ... refactor ...
    python tools/behaviour_snapshot.py --out /tmp/after.json [--eagle1 HEAD_FOLDER]
    cmp /tmp/before.json /tmp/after.json

SmolLM2 (the offline GGUF) runs plain, n-gram, itself as its own draft, dynamic K (the profile in
bench_results/ as its step-time table) and, with --eagle1, a trained EAGLE-1 head; EAGLE-3 runs on
a small random target and head built in code (tests/conftest.py), since none is trained for SmolLM2.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.checkpoint import default_model_path  # noqa: E402

PROFILE = os.path.join(ROOT, "bench_results", "dynamic_k_cpu_profile_b1_4_16.json")


def shipped_prompts() -> list[str]:
    with open(os.path.join(ROOT, "nanospec", "data", "prompts.jsonl")) as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def outputs(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    ids = [llm.encode_prompt(p, chat=True) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(ids, params)]


def replay_table() -> str:
    """The replay's printed table (benchmarks/replay.py; in older checkouts tools/ or nanospec/)."""
    try:
        from benchmarks import replay
    except ImportError:
        try:
            from tools import replay
        except ImportError:
            from nanospec import replay
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        replay.main(["--profile", PROFILE, "--batch-sizes", "1,4", "--num-requests", "8", "--max-new-tokens",
                     "32", "--device", "cpu", "--dtype", "float32"])
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--eagle1", help="a trained EAGLE-1 head for SmolLM2 (float32), e.g. from train_eagle.py")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    prompts = shipped_prompts()
    smol = default_model_path()
    base = dict(device="cpu", dtype="float32", max_num_seqs=64)
    runs = {"plain": {}, "ngram": dict(ngram=True, num_speculative_tokens=4),
            "draft": dict(draft=smol, num_speculative_tokens=3),
            "dynamic_k": dict(ngram=True, num_speculative_tokens=6, dynamic_k=True, profile=PROFILE),
            "dynamic_k_per_request": dict(ngram=True, num_speculative_tokens=6, dynamic_k=True,
                                          profile=PROFILE, per_request_k=True)}
    if args.eagle1:
        runs["eagle1"] = dict(eagle=args.eagle1, num_speculative_tokens=3)
    result = {}
    for name, kwargs in runs.items():
        result[name] = outputs(LLM(smol, **base, **kwargs), prompts, args.max_tokens)
        print(f"{name}: {sum(map(len, result[name]))} tokens", file=sys.stderr)
    from conftest import write_checkpoint, write_eagle_head
    with tempfile.TemporaryDirectory() as tmp:
        target = write_checkpoint(os.path.join(tmp, "target"), "llama3", seed=3, num_layers=4)
        head = write_eagle_head(os.path.join(tmp, "eagle3"), target, 3, seed=6, draft_vocab=200)
        for name, kwargs in {"tiny_plain": {},
                             "tiny_eagle3": dict(eagle=head, num_speculative_tokens=3)}.items():
            llm = LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, **kwargs)
            # the small random tokenizer spends a token or more a byte
            short = [p[:200] for p in prompts[:16]]
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            result[name] = [o.token_ids for o in llm.generate(short, params)]
    for name in result:
        same = result[name] == result["plain" if not name.startswith("tiny") else "tiny_plain"]
        print(f"{name}: equal to plain decoding: {same}", file=sys.stderr)
    result["replay"] = replay_table()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0)


if __name__ == "__main__":
    main()
