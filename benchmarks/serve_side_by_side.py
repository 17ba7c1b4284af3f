"""The serving benchmark of nanospec and vLLM on one model, prompts, client and machine. The two
servers of a pair (plain, n-gram) are up together and measured by `python -m nanospec.bench
serve`'s client in turn, load by load (concurrency 1, 4, 16, 1 and 4 requests/s), `--rounds` times,
so that a slow minute of a shared machine falls on both; then nanospec's dynamic K alone. Multi-turn
sessions (bench serve --dataset multiturn's: 3 turns, each sent with the server's own answers so
far, 1 and 4 sessions at once) on vLLM's and nanospec's n-gram and suffix decoding (vLLM's needs
ArcticInference in its venv), with each server's prefix caching on (their default), new sessions
every round. nanospec's server overhead: its TPOT at concurrency 1 against offline generate in this
process, alternated. The running streams' ITL while long prompts arrive: decode steps between
prefill chunks against --prefill-first. Writes one JSON with every row and the command.

example (vLLM's CPU build in a venv of its own, serving an HF folder; see DEVELOPERS.md):
  python -m benchmarks.serve_side_by_side --model /tmp/vllm/smollm2 --vllm-python /tmp/vllm/venv/bin/python \\
      --out bench_results/serve_cpu_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from nanospec import LLM, SamplingParams
from nanospec.bench_serve import (HEADER, Client, format_row, load_prompts, run_load, run_sessions,
                                  shipped_sessions, spec_counters, summarize)
from nanospec.cli import busy_cores, set_threads
from nanospec.prompts import shipped_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# vLLM's suffix decoding (ArcticInference's, which it imports) at nanospec's ceiling of 16 drafts; its
# other settings are its defaults (depth 24, max_spec_factor 1, max_spec_offset 0, min_token_prob 0.1),
# which nanospec's suffix takes with --suffix-max-spec-offset 0 (by default it drafts up to 3 more)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 16}
WARM_UP = ["Say hello.", "Name a colour."]
MULTITURN_TOKENS = 128   # a multi-turn answer's ceiling: long enough for later turns to revisit it
LOADS = [("concurrency 1", None, 1), ("concurrency 4", None, 4), ("concurrency 16", None, 16),
         ("rate 1/s", 1.0, None), ("rate 4/s", 4.0, None)]


def start(cmd: list[str], port: int, env: dict, log_path: str, timeout: float = 900) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, start_new_session=True)
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


def model_name(port: int) -> str:
    return json.loads(Client(f"http://127.0.0.1:{port}", None).get("/v1/models"))["data"][0]["id"]


def warm_up(port: int, prompts: list[str]) -> None:
    run_load(Client(f"http://127.0.0.1:{port}", None), "chat", bodies(model_name(port), prompts[:2], 8),
             float("inf"), None, 0)


def settle(limit: float = 15.0) -> None:
    """Wait until the machine is quiet: vLLM's CPU worker keeps a core busy for about a second after
    its last request, which would fall on the next server's first request."""
    deadline = time.time() + limit
    while busy_cores(0.5) > 0.3 and time.time() < deadline:
        pass


def measure(port: int, label: str, load: tuple, prompts: list[str], max_tokens: int, rows: list,
            round_: int) -> dict:
    """One load against one server, once the machine is quiet: a row of the bench serve summary."""
    name, rate, concurrency = load
    settle()
    client = Client(f"http://127.0.0.1:{port}", None)
    before = spec_counters(client)
    results, duration = run_load(client, "chat", bodies(model_name(port), prompts, max_tokens),
                                 rate or float("inf"), concurrency, 0)
    summary = summarize(results, duration, before, spec_counters(client))
    rows.append({"server": label, "load": name, "round": round_, **summary})
    print(format_row(f"{label}, {name}", summary), flush=True)
    return summary


def measure_sessions(port: int, label: str, concurrency: int, first: int, count: int, max_tokens: int,
                     rows: list, round_: int) -> dict:
    """Multi-turn sessions of the shipped prompts first .. first + count - 1 (by category in turn),
    `concurrency` at once, each turn sent with the answers this server gave: a row as measure()'s."""
    settle()
    client = Client(f"http://127.0.0.1:{port}", None)
    before = spec_counters(client)
    sessions = shipped_sessions(count, 3, first)
    body = {"model": model_name(port), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    summary = summarize(*run_sessions(client, body, sessions, concurrency), before, spec_counters(client))
    name = f"multiturn, {concurrency} sessions at once"
    rows.append({"server": label, "load": name, "round": round_, "sessions_from": first, **summary})
    print(format_row(f"{label}, {name}", summary), flush=True)
    return summary


def long_prompt_itl(port: int, label: str, prompts: list[str], rows: list) -> None:
    """ITL of 4 running streams while four ~1,900-token prompts arrive, one a second."""
    import threading
    client, model = Client(f"http://127.0.0.1:{port}", None), model_name(port)
    long_text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 140)
    streams = bodies(model, prompts[:8], 128, {"ignore_eos": True})
    longs = bodies(model, [long_text] * 4, 1)
    out = {}
    runner = threading.Thread(
        target=lambda: out.update(r=run_load(client, "chat", streams, float("inf"), 4, 0)))
    runner.start()
    time.sleep(3)
    run_load(client, "chat", longs, 1.0, None, 0)
    runner.join()
    summary = summarize(*out["r"], {}, {})
    rows.append({"server": label, "load": "4 streams + 1.9k-token prompts at 1/s", **summary})
    print(format_row(f"{label}, long prompts", summary), flush=True)


def offline_tpot(llm: LLM, prompts: list[str], max_tokens: int) -> float:
    """TPOT p50 of offline generate, one prompt at a time (what concurrency 1 asks of the server)."""
    tpots = []
    for p in prompts:
        times = []
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens), chat=True,
                           on_step=lambda reqs: times.append(time.perf_counter()) if reqs else None)[0]
        if len(out.token_ids) > 1:
            tpots.append((times[-1] - times[0]) / (len(out.token_ids) - 1))
    return statistics.median(tpots)


def overhead(port: int, model: str, prompts: list[str], max_tokens: int, rounds: int) -> dict:
    """The server's TPOT p50 at concurrency 1 against offline generate's in this process (the
    server idle meanwhile), alternated `rounds` times; the ratio of the medians."""
    set_threads(None)
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=2048)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), chat=True)   # warm-up
    served, offline = [], []
    for round_ in range(rounds):
        served.append(measure(port, "nanospec plain", LOADS[0], prompts, max_tokens, [],
                              round_)["tpot_s"]["p50"])
        settle()
        offline.append(offline_tpot(llm, prompts, max_tokens))
        print(f"offline generate, one prompt at a time: TPOT p50 {1000 * offline[-1]:.1f} ms", flush=True)
    return {"server_tpot_p50_s": served, "offline_tpot_p50_s": offline,
            "ratio_of_medians": statistics.median(served) / statistics.median(offline)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder both servers load")
    ap.add_argument("--vllm-python", help="the python of vLLM's venv (default: no vLLM rows)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="times each load is run on each server, in turn")
    ap.add_argument("--only", default="",
                    help="comma-separated parts to run: plain, ngram, dynamic, overhead, long (default: "
                         "these), multiturn (its vLLM suffix server needs ArcticInference in vLLM's venv)")
    ap.add_argument("--sessions", type=int, default=8,
                    help="multiturn: sessions of 3 turns a round (other prompts each round, so that no "
                         "server finds a round cached)")
    ap.add_argument("--nanospec-args", default="",
                    help="more flags for nanospec's server, e.g. '--threads 1'")
    ap.add_argument("--out", required=True)
    return ap


VLLM_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_server(python: str, model: str) -> list[str]:
    """vLLM's OpenAI server on an HF folder, as every side by side runs it (float32, run with VLLM_ENV)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--max-model-len", "2048"]


def server_groups(args) -> tuple[list[str], list]:
    """nanospec's server command, and the groups of servers up together: (group, [(label, command, env)])."""
    nanospec = [sys.executable, "-m", "nanospec.serve", "--target", args.model, "--max-model-len", "2048",
                *args.nanospec_args.split()]
    vllm, vllm_env = vllm_server(args.vllm_python, args.model), VLLM_ENV
    groups = [("plain", [("vLLM plain", vllm, vllm_env), ("nanospec plain", nanospec, {})]),
              ("ngram", [("vLLM ngram K=4", vllm + ["--speculative-config", json.dumps(NGRAM)], vllm_env),
                         ("nanospec ngram K=4", nanospec + ["--ngram"], {})]),
              ("dynamic", [("nanospec ngram dynamic K", nanospec + ["--ngram", "--dynamic-k"], {})]),
              ("multiturn", [("vLLM ngram K=4", vllm + ["--speculative-config", json.dumps(NGRAM)], vllm_env),
                             ("vLLM suffix", vllm + ["--speculative-config", json.dumps(SUFFIX)], vllm_env),
                             ("nanospec ngram K=4", nanospec + ["--ngram"], {}),
                             ("nanospec suffix", nanospec + ["--suffix"], {}),
                             ("nanospec suffix+0", nanospec + ["--suffix", "--suffix-max-spec-offset", "0"],
                              {})])]
    return nanospec, groups


def run_group(group: str, servers: list, port: int, args, prompts, rows: list, save) -> int:
    """The group's servers up together, measured in turn; returns the last port taken."""
    procs = []
    try:
        for label, cmd, env in servers:
            port += 1
            procs.append((label, port, start(cmd + ["--port", str(port)], port, env,
                                             f"/tmp/serve_{label.replace(' ', '_')}.log")))
            # (the multi-turn sessions' servers warm up on prompts none of them sends: nothing cached)
            warm_up(port, WARM_UP if group == "multiturn" else prompts)
        # both prefix caches on (each server's default), every round new sessions
        if group == "multiturn":
            for concurrency in (1, 4):
                for round_ in range(args.rounds):
                    first = (2 * round_ + (concurrency > 1)) * args.sessions
                    for label, p, _ in procs:
                        measure_sessions(p, label, concurrency, first, args.sessions, MULTITURN_TOKENS, rows,
                                         round_)
                    save()
            return port
        for load in LOADS:
            for round_ in range(args.rounds):
                for label, p, _ in procs:
                    measure(p, label, load, prompts, args.max_tokens, rows, round_)
            save()
    finally:
        for *_, proc in procs:
            stop(proc)
    return port


def run_alone(nanospec: list[str], only: set, port: int, args, prompts, rows: list, result: dict,
              save) -> None:
    """nanospec's server alone: its overhead over offline decoding, and a long prompt's ITL (decoding
    between prefill chunks, then with --prefill-first)."""
    if "overhead" in only or "long" in only:
        port += 1
        proc = start(nanospec + ["--port", str(port)], port, {}, "/tmp/serve_nanospec_overhead.log")
        try:
            warm_up(port, prompts)
            if "overhead" in only:
                result["overhead_concurrency_1"] = overhead(port, args.model, prompts, args.max_tokens, 3)
                print("server / offline TPOT p50:", result["overhead_concurrency_1"], flush=True)
                save()
            if "long" in only:
                long_prompt_itl(port, "nanospec plain (decode between chunks)", prompts, rows)
        finally:
            stop(proc)
    if "long" in only:
        port += 1
        proc = start(nanospec + ["--port", str(port), "--prefill-first"], port, {},
                     "/tmp/serve_prefill_first.log")
        try:
            long_prompt_itl(port, "nanospec plain (--prefill-first)", prompts, rows)
        finally:
            stop(proc)


def main() -> None:
    args = build_parser().parse_args()
    prompts = load_prompts("shipped", args.num_prompts)
    only = set(filter(None, args.only.split(","))) or {"plain", "ngram", "dynamic", "overhead", "long"}
    if "multiturn" in only and 2 * args.rounds * args.sessions > len(shipped_prompts()):
        sys.exit(f"--only multiturn: {2 * args.rounds} runs of {args.sessions} new sessions need more than "
                 f"the {len(shipped_prompts())} shipped prompts: fewer --sessions or --rounds")
    nanospec, groups = server_groups(args)
    rows = []
    result = {"command": "python -m benchmarks.serve_side_by_side " + " ".join(sys.argv[1:]),
              "prompts": "shipped",
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "temperature": 0,
              "endpoint": "chat", "rounds": args.rounds, "rows": rows,
              **({"multiturn_sessions": args.sessions, "multiturn_turns": 3,
                  "multiturn_max_tokens": MULTITURN_TOKENS}
                 if "multiturn" in only else {})}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(HEADER, flush=True)
    port = 8200
    for group, servers in groups:
        servers = [s for s in servers if args.vllm_python or not s[0].startswith("vLLM")]
        if group in only and servers:
            port = run_group(group, servers, port, args, prompts, rows, save)
    run_alone(nanospec, only, port, args, prompts, rows, result, save)
    save()


if __name__ == "__main__":
    main()
