"""The sweep's servers (benchmarks/serve_sweep.py's rows) measured by vLLM's own client, `vllm bench
serve`, instead of nanospec's: every chosen server up together, each load (concurrency or request
rate) run against each server in turn, the order rotated each round, medians of the rounds. The
prompts are the shipped ones, in chat, as the sweep sends them (a custom JSON-lines dataset of
vLLM's client), each answer exactly --max-tokens long (ignore_eos), greedy.

example (vLLM's CPU build in a venv of its own, serving the HF folder of tools/gguf_to_hf.py):
  python -m benchmarks.serve_vllm_client --model /tmp/smollm2 --vllm-python /work/vllm-venv/bin/python \\
      --rows "nanospec plain" "nanospec ngram K=4" "vLLM plain" "vLLM ngram K=4" \\
      --concurrencies 1 4 16 --request-rates 1 2 --rounds 2 --out bench_results/serve_vllm_client_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.serve_ab import CLIENT, METRICS
from benchmarks.serve_side_by_side import settle, start, stop, warm_up
from benchmarks.serve_sweep import servers
from nanospec.prompts import shipped_prompts

NAME = "smollm2"   # the model name every server answers to (--served-model-name)


def run_client(args, url: str, load: dict, dataset: str, seed: int) -> dict:
    """One load against one server through `vllm bench serve`; its figures (METRICS)."""
    how = (["--max-concurrency", str(load["concurrency"])] if "concurrency" in load
           else ["--request-rate", str(load["rate"])])
    # enough requests that the concurrency is reached, twice over
    num_prompts = max(args.num_prompts, 2 * load.get("concurrency", 0))
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai-chat",
               "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", NAME,
               "--tokenizer", args.model, "--dataset-name", "custom",
               "--dataset-path", dataset, "--skip-chat-template", "--num-prompts", str(num_prompts),
               "--custom-output-len", str(args.max_tokens), *how, "--ignore-eos", "--temperature", "0",
               "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
               "--disable-tqdm", "--save-result", "--result-dir", out, "--result-filename", "r.json"]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork"})
        if done.returncode:
            raise SystemExit(f"vllm bench serve failed:\n{done.stderr[-3000:]}")
        with open(os.path.join(out, "r.json")) as f:
            result = json.load(f)
    if result["completed"] != num_prompts:
        raise SystemExit(f"{url}: {num_prompts - result['completed']} of {num_prompts} requests failed")
    return {"completed": result["completed"], **{key: result[key] for key in METRICS}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_vllm_client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/smollm2",
                    help="the HF folder vLLM serves, and the client's tokenizer")
    ap.add_argument("--vllm-python", required=True, help="the python of vLLM's venv (its server and client)")
    ap.add_argument("--rows", nargs="+", metavar="LABEL", help="serve_sweep's rows to measure (default: all)")
    ap.add_argument("--concurrencies", type=int, nargs="*", default=[1, 4, 16, 32])
    ap.add_argument("--request-rates", type=float, nargs="*", default=[1.0, 2.0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8740)
    ap.add_argument("--disable-queue-size", type=int, default=8)
    ap.add_argument("--mixed", type=int, nargs="*", metavar="N",
                    help="rows of the plain and n-gram K=4 servers with --mixed-prefill-tokens N too")
    ap.add_argument("--out", required=True, metavar="FILE.json")
    args = ap.parse_args(argv)
    every = servers(args)
    chosen = [row for row in every if not args.rows or row[0] in args.rows]
    if args.rows and len(chosen) != len(args.rows):
        raise SystemExit(f"--rows takes labels among {[label for label, *_ in every]}, got {args.rows}")
    loads = ([{"concurrency": c} for c in args.concurrencies] + [{"rate": r} for r in args.request_rates])
    prompts = [r["prompt"] for r in shipped_prompts()]
    procs, urls, rows = [], {}, []
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        dataset = f.name
    try:
        for i, (label, cmd, env) in enumerate(chosen):
            port = args.port + i
            procs.append(start(cmd + ["--port", str(port), "--served-model-name", NAME], port, env,
                               f"/tmp/serve_vllm_client_{port}.log"))
            warm_up(port, prompts)
            urls[label] = f"http://127.0.0.1:{port}"
        labels = list(urls)
        for round_ in range(args.rounds):
            for load in loads:
                # reversed every other round (each server's place mirrored), rotated every two rounds
                shift = (round_ // 2) % len(labels)
                order = labels[shift:] + labels[:shift]
                for label in (order if round_ % 2 == 0 else order[::-1]):
                    settle()
                    row = {"server": label, **load, "round": round_,
                           **run_client(args, urls[label], load, dataset, seed=round_)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            stop(proc)
        os.unlink(dataset)
    same = lambda label, load: [r for r in rows
                                if r["server"] == label and all(r.get(k) == v for k, v in load.items())]
    medians = [{"server": label, **load, **{key: statistics.median(r[key] for r in same(label, load))
                                             for key in METRICS}}
               for load in loads for label in urls]
    with open(args.out, "w") as f:
        command = "python -m benchmarks.serve_vllm_client " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump({"command": command, "medians": medians, "rows": rows}, f, indent=1)
    for m in medians:
        print(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
