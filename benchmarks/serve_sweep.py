"""The seeds' figure: output throughput and TPOT against concurrency and request rate, for nanospec
plain, n-gram at K = 2 and 4, dynamic K, and dynamic K with the queue-size switch-off, and for vLLM
plain and n-gram K = 4, through one client (`python -m nanospec.bench serve --sweep`). Starts every
server (on ports from --port up), warms each up, runs the sweep (the servers measured in turn, the
order rotated each round), stops them; the JSON and the PNG go to --out. Flags it does not know go
to bench serve (--concurrencies, --request-rates, --rounds, --extra-body: default ignore_eos).

example (vLLM's CPU build in a venv of its own serving the HF folder of tools/gguf_to_hf.py):
  python -m benchmarks.serve_sweep --model /tmp/smollm2 --vllm-python /work/vllm-venv/bin/python \\
      --rounds 2 --out bench_results/serve_sweep_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.serve_side_by_side import NGRAM, VLLM_ENV, start, stop, vllm_server, warm_up
from nanospec import bench_serve
from nanospec.prompts import shipped_prompts


def servers(args) -> list[tuple[str, list[str], dict]]:
    """(label, command, environment) of every row; vLLM's only with --vllm-python."""
    # every core, as on a quiet machine: by default a server takes the cores others leave free when it
    # starts, and the servers started before it may still be warming up
    nanospec = [sys.executable, "-m", "nanospec.serve", "--max-model-len", "2048", "--threads",
                str(os.cpu_count())]
    switch_off = ["--speculative-disable-queue-size", str(args.disable_queue_size)]
    rows = [("nanospec plain", nanospec, {}),
            ("nanospec ngram K=2", nanospec + ["--ngram", "--num-speculative-tokens", "2"], {}),
            ("nanospec ngram K=4", nanospec + ["--ngram", "--num-speculative-tokens", "4"], {}),
            ("nanospec ngram dynamic K", nanospec + ["--ngram", "--dynamic-k"], {}),
            (f"nanospec dynamic K, off past {args.disable_queue_size}",
             nanospec + ["--ngram", "--dynamic-k", *switch_off], {})]
    for n in getattr(args, "mixed", None) or ():   # prefill chunks of n tokens ride in decode steps
        mixed = ["--mixed-prefill-tokens", str(n)]
        rows += [(f"nanospec plain, mixed {n}", nanospec + mixed, {}),
                 (f"nanospec ngram K=4, mixed {n}",
                  nanospec + ["--ngram", "--num-speculative-tokens", "4", *mixed], {})]
    if args.vllm_python:
        vllm = vllm_server(args.vllm_python, args.model)
        rows += [("vLLM plain", vllm, VLLM_ENV),
                 ("vLLM ngram K=4", vllm + ["--speculative-config", json.dumps(NGRAM)], VLLM_ENV)]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/smollm2", help="the HF folder vLLM serves (nanospec serves "
                    "the GGUF it was made from, the default model)")
    ap.add_argument("--vllm-python", help="a venv's python with vLLM (without: nanospec's rows alone)")
    ap.add_argument("--port", type=int, default=8720)
    ap.add_argument("--disable-queue-size", type=int, default=8)
    ap.add_argument("--mixed", type=int, nargs="*", metavar="N",
                    help="rows of the plain and n-gram K=4 servers with --mixed-prefill-tokens N too")
    ap.add_argument("--rows", nargs="+", metavar="LABEL", help="only these rows, by label (default: all)")
    ap.add_argument("--out", required=True, metavar="FILE.json")
    args, sweep_args = ap.parse_known_args(argv)   # the rest goes to bench serve --sweep
    if "--extra-body" not in sweep_args:   # every answer its full length, unless told otherwise
        sweep_args += ["--extra-body", '{"ignore_eos": true}']
    every = servers(args)
    labels = [label for label, *_ in every]
    if args.rows and not set(args.rows) <= set(labels):
        raise SystemExit(f"--rows takes labels among {labels}, got {args.rows}")
    checked = bench_serve.build_parser().parse_args(["--sweep", "x=http://127.0.0.1:1", "--out", args.out,
                                                     *sweep_args])
    bench_serve.check_args(checked)
    bench_serve.sweep_plan(checked)   # its flags checked before minutes of starting servers
    procs, urls = [], []
    try:
        rows = [row for row in every if not args.rows or row[0] in args.rows]
        for i, (label, cmd, env) in enumerate(rows):
            port = args.port + i
            log = f"/tmp/serve_sweep_{port}.log"
            print(f"starting {label} on port {port} (log: {log})", flush=True)
            procs.append(start(cmd + ["--port", str(port)], port, env, log))
            warm_up(port, [r["prompt"] for r in shipped_prompts()])
            urls.append(f"{label}=http://127.0.0.1:{port}")
        bench = bench_serve.build_parser().parse_args(
            ["--sweep", *urls, "--out", args.out, *sweep_args])
        report = bench_serve.run(bench)
    finally:
        for proc in procs:
            stop(proc)
    report["command"] = "python -m benchmarks.serve_sweep " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
