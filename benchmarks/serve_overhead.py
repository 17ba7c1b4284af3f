"""What the server costs over the offline engine (issue 63, item 1): one LLM in this process, measured
in turn as offline `generate` (max_num_seqs = the concurrency) and as the OpenAI server (`serve()`, its
engine loop on this thread and uvicorn on another, as `python -m nanospec.serve` runs them) under
nanospec's own client (`python -m nanospec.bench serve`, a process of its own) keeping the same
concurrency in flight. Same prompts (the shipped ones, as completions), same max_tokens with
ignore_eos, greedy, same K; modes alternated and rounds repeated, medians.

Where the server's time goes, per run:
- steps_s: time inside Engine.step (its count: steps), against offline's on the same work;
- loop_s: the engine loop's time outside its steps, from its first to its last (taking requests,
  handing out updates, waiting for the next request between a client's requests);
- cpu_s per thread of this process (the engine loop, uvicorn's thread, torch's OpenMP workers, the
  rest) from /proc, and the client's CPU time: on a machine with few cores, the HTTP thread and
  the client take their CPU from the engine's.

example:
  python -m benchmarks.serve_overhead --concurrencies 1 4 16 32 --rounds 3 \\
      --out bench_results/serve_overhead_cpu.json
  python -m benchmarks.serve_overhead --ngram --num-speculative-tokens 4 ...
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.measure import cpu_flags
from nanospec.cli import add_llm_args, frozen_gc_heap, load_llm
from nanospec.prompts import shipped_prompts
from nanospec.sampling_params import SamplingParams
from nanospec.serve import Server, serve

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each of this process's threads, by native id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK   # utime, stime
    return out


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class StepTimer:
    """Engine.step wrapped: the time inside it and the steps taken."""

    def __init__(self, engine):
        self.seconds, self.steps, step = 0.0, 0, engine.step
        self.first = self.last = 0.0   # when the first step of a run began (reset), the latest ended

        def timed():
            start = time.perf_counter()
            self.first = self.first or start
            try:
                return step()
            finally:
                self.last = time.perf_counter()
                self.seconds += self.last - start
                self.steps += 1
        engine.step = timed


def cpu_split(before: dict[int, float], after: dict[int, float], http_tid: int | None) -> dict:
    delta = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = os.getpid()
    split = {"engine_loop": delta.pop(main, 0.0), "http": delta.pop(http_tid, 0.0) if http_tid else 0.0}
    split["others"] = sum(delta.values())   # torch's OpenMP workers, mostly
    return split


def offline(llm, timer: StepTimer, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    scheduler = llm.engine.scheduler
    scheduler.max_num_seqs, scheduler.decode_between_prefills = concurrency, False
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps, seconds, cpu = timer.steps, timer.seconds, thread_cpu()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_throughput": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "steps": timer.steps - steps, "steps_s": timer.seconds - seconds,
            "cpu_s": cpu_split(cpu, thread_cpu(), None)}


def served(llm, timer: StepTimer, prompts: list[str], concurrency: int, max_tokens: int,
           max_num_seqs: int, prefill_first: bool = False) -> dict:
    """One run of the server under the client (the same prompts, as a JSON-lines dataset); the server
    stops when the client is done."""
    llm.engine.scheduler.max_num_seqs = max_num_seqs
    server = Server(llm, "served", decode_between_prefills=not prefill_first)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        out, dataset = os.path.join(tmp, "client.json"), os.path.join(tmp, "prompts.jsonl")
        with open(dataset, "w") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
        cmd = [sys.executable, "-m", "nanospec.bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--endpoint", "completions", "--dataset", dataset, "--num-prompts", str(len(prompts)),
               "--max-tokens", str(max_tokens), "--max-concurrency", str(concurrency),
               "--extra-body", json.dumps({"ignore_eos": True}), "--out", out]

        def client():
            try:
                result["client_cpu_s"] = -children_cpu()
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                result["client_cpu_s"] += children_cpu()
                # uvicorn's thread is still up: its CPU time can be read
                result["cpu_after"], result["end"] = thread_cpu(), time.perf_counter()
                if done.returncode:
                    result["error"] = done.stderr[-2000:]
            except subprocess.TimeoutExpired:
                result["error"] = "the client ran past 30 minutes"
            finally:
                server.loop.stop()   # the loop ends, then serve() takes uvicorn down and returns
        steps, seconds, cpu = timer.steps, timer.seconds, thread_cpu()
        timer.first = 0.0
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        http_tid = []
        original = threading.Thread.start

        def start_noting(thread):   # serve()'s uvicorn thread: its id, for its CPU time
            original(thread)
            if thread.name == "http":
                http_tid.append(thread.native_id)
        threading.Thread.start = start_noting
        try:
            serve(server, sock, graceful_seconds=5)
        finally:
            threading.Thread.start = original
            thread.join()
        loop_wall = timer.last - timer.first   # from the first step to the last
        if "error" in result:
            raise SystemExit(f"the client failed:\n{result['error']}")
        with open(out) as f:
            report = json.load(f)
    step_s = timer.seconds - seconds
    return {"output_throughput": report["output_throughput"], "output_tokens": report["output_tokens"],
            "wall_s": report["duration_s"], "failed": report["failed"], "steps": timer.steps - steps,
            "steps_s": step_s, "loop_s": loop_wall - step_s,
            "tpot_p50_s": report["tpot_s"]["p50"], "itl_p99_s": report["itl_s"]["p99"],
            "cpu_s": {**cpu_split(cpu, result["cpu_after"], http_tid[0] if http_tid else None),
                      "client": result["client_cpu_s"]},
            "http_thread_found": bool(http_tid)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llm_args(ap, dtype="float32")
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--prompts-per-slot", type=int, default=2,
                    help="requests per load: this times the concurrency (at least 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-first", action="store_true", help="the server prefills first, as offline")
    ap.add_argument("--out", required=True)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    llm = load_llm(args, max_num_seqs=max(args.concurrencies), max_num_batched_tokens=512)
    timer = StepTimer(llm.engine)
    shipped = [r["prompt"] for r in shipped_prompts()]
    for c in args.concurrencies:   # warm-up: the compiled sampler's shapes of every batch size
        llm.engine.scheduler.max_num_seqs = c
        llm.generate(shipped[:c], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    report = {"command": "python -m benchmarks.serve_overhead " + " ".join(sys.argv[1:]),
              "cpu_flags": cpu_flags(), "loads": {}}
    with frozen_gc_heap():
        for r in range(args.rounds):
            for c in args.concurrencies:
                n = max(4, args.prompts_per_slot * c)
                prompts = [shipped[i % len(shipped)] for i in range(n)]
                runs = report["loads"].setdefault(str(c), {"offline": [], "server": []})
                order = ["offline", "server"] if r % 2 == 0 else ["server", "offline"]
                for mode in order:
                    run = (offline(llm, timer, prompts, c, args.max_tokens) if mode == "offline"
                           else served(llm, timer, prompts, c, args.max_tokens, max(args.concurrencies),
                                       args.prefill_first))
                    runs[mode].append(run)
                    print(f"round {r + 1} c={c} {mode}: {run['output_throughput']:.1f} tok/s, "
                          f"{run['steps']} steps in {run['steps_s']:.2f} s, "
                          f"loop {run.get('loop_s', 0):.2f} s, "
                          f"cpu {json.dumps(run['cpu_s'])}", flush=True)
                    time.sleep(1)
                med = {m: statistics.median(x["output_throughput"] for x in runs[m])
                       for m in ("offline", "server")}
                runs["server_over_offline"] = med["server"] / med["offline"]
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    for c, runs in report["loads"].items():
        print(f"concurrency {c}: server / offline output tokens/s {runs['server_over_offline']:.3f}")


if __name__ == "__main__":
    main()
