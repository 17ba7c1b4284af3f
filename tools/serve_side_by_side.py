"""The serving benchmark of nanospec and vLLM on one model, prompts, client and machine: each server
is started, measured by `python -m nanospec.bench serve`'s client at several concurrencies and
request rates, and stopped; then nanospec's server overhead against offline generate at
concurrency 1, and the running streams' ITL while long prompts arrive (decode steps between
prefill chunks, against --prefill-first). Writes one JSON with every row and the command.

example (vLLM's CPU build in a venv of its own, serving an HF folder; see DEVELOPERS.md):
  python tools/serve_side_by_side.py --model /tmp/vllm/smollm2 --vllm-python /tmp/vllm/venv/bin/python \
      --out bench_results/serve_cpu_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanospec import LLM, SamplingParams  # noqa: E402
from nanospec.bench_serve import HEADER, Client, format_row, load_prompts, run_load, spec_counters, summarize  # noqa: E402
from nanospec.cli import set_threads  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
LOADS = [("concurrency 1", None, 1), ("concurrency 4", None, 4), ("concurrency 16", None, 16),
         ("rate 1/s", 1.0, None), ("rate 4/s", 4.0, None)]


def start(cmd: list[str], port: int, env: dict, log_path: str, timeout: float = 900) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env={**os.environ, **env},
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode}; see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{cmd[:4]} did not come up in {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bodies(model: str, prompts: list[str], max_tokens: int, extra: dict | None = None) -> list[dict]:
    return [{"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
             "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
            for p in prompts]


def measure(port: int, label: str, prompts: list[str], max_tokens: int, rows: list) -> None:
    client = Client(f"http://127.0.0.1:{port}", None)
    model = json.loads(client.get("/v1/models"))["data"][0]["id"]
    run_load(client, "chat", bodies(model, prompts[:2], 8), float("inf"), None, 0)   # warm-up
    for load, rate, concurrency in LOADS:
        before = spec_counters(client)
        results, duration = run_load(client, "chat", bodies(model, prompts, max_tokens), rate or float("inf"),
                                     concurrency, 0)
        summary = summarize(results, duration, before, spec_counters(client))
        rows.append({"server": label, "load": load, **summary})
        print(format_row(f"{label}, {load}", summary), flush=True)


def long_prompt_itl(port: int, label: str, prompts: list[str], rows: list) -> None:
    """ITL of 4 running streams while four ~1,900-token prompts arrive, one a second."""
    import threading
    client = Client(f"http://127.0.0.1:{port}", None)
    model = json.loads(client.get("/v1/models"))["data"][0]["id"]
    long_text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 140)
    streams = bodies(model, prompts[:8], 128, {"ignore_eos": True})
    longs = bodies(model, [long_text] * 4, 1)
    out = {}
    runner = threading.Thread(target=lambda: out.update(r=run_load(client, "chat", streams, float("inf"), 4, 0)))
    runner.start()
    time.sleep(3)
    run_load(client, "chat", longs, 1.0, None, 0)
    runner.join()
    summary = summarize(*out["r"], {}, {})
    rows.append({"server": label, "load": "4 streams + 1.9k-token prompts at 1/s", **summary})
    print(format_row(f"{label}, long prompts", summary), flush=True)


def offline_tpot(model: str, prompts: list[str], max_tokens: int) -> dict:
    """TPOT of offline generate, one prompt at a time (what concurrency 1 asks of the server)."""
    set_threads(None)
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=2048)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), chat=True)   # warm-up
    tpots = []
    for p in prompts:
        times = []
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens), chat=True,
                           on_step=lambda reqs: times.append(time.perf_counter()) if reqs else None)[0]
        if len(out.token_ids) > 1:
            tpots.append((times[-1] - times[0]) / (len(out.token_ids) - 1))
    tpots.sort()
    return {"requests": len(tpots), "tpot_mean_s": sum(tpots) / len(tpots), "tpot_p50_s": tpots[len(tpots) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder both servers load")
    ap.add_argument("--vllm-python", help="the python of vLLM's venv (default: no vLLM rows)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", default="", help="comma-separated server labels to run (default: all)")
    ap.add_argument("--long-prompts-only", action="store_true",
                    help="only the long-prompt ITL rows (nanospec, with and without --prefill-first)")
    ap.add_argument("--nanospec-args", default="", help="more flags for nanospec's server, e.g. '--threads 1'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prompts = load_prompts("shipped", args.num_prompts)
    py = sys.executable
    nanospec = [py, "-m", "nanospec.serve", "--target", args.model, "--max-model-len", "2048", *args.nanospec_args.split()]
    servers = [("nanospec plain", nanospec, {}), ("nanospec ngram K=4", nanospec + ["--ngram"], {}),
               ("nanospec ngram dynamic K", nanospec + ["--ngram", "--dynamic-k"], {})]
    if args.vllm_python:
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype",
                "float32", "--max-model-len", "2048"]
        env = {"VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_CPU_KVCACHE_SPACE": "2"}
        servers = [("vLLM plain", vllm, env), servers[0],
                   ("vLLM ngram K=4", vllm + ["--speculative-config", json.dumps(NGRAM)], env), *servers[1:]]
    only = [s for s in args.only.split(",") if s]
    rows = []
    result = {"command": "python tools/serve_side_by_side.py " + " ".join(sys.argv[1:]), "prompts": "shipped",
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "temperature": 0, "endpoint": "chat",
              "rows": rows}
    print(HEADER, flush=True)
    for label, cmd, env in servers:
        if only and label not in only:
            continue
        port = 8200 + 2 * len(result.setdefault("servers", []))
        result["servers"].append(label)
        proc = start(cmd + ["--port", str(port)], port, env, f"/tmp/serve_{label.replace(' ', '_')}.log")
        try:
            if not args.long_prompts_only:
                measure(port, label, prompts, args.max_tokens, rows)
            if label == "nanospec plain":
                long_prompt_itl(port, label + " (decode between chunks)", prompts, rows)
        finally:
            stop(proc)
        if label == "nanospec plain":
            proc = start(cmd + ["--port", str(port + 1), "--prefill-first"], port + 1, env, "/tmp/serve_prefill_first.log")
            try:
                long_prompt_itl(port + 1, label + " (--prefill-first)", prompts, rows)
            finally:
                stop(proc)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if not only or "offline" in only:
        result["offline_concurrency_1"] = offline_tpot(args.model, prompts, args.max_tokens)
        print("offline generate, one prompt at a time:", result["offline_concurrency_1"], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
