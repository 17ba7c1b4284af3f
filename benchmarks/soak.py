"""A soak of the server (issue 63, item 5): minutes of Poisson arrivals on one `python -m nanospec.serve`
(the real SmolLM2 with suffix decoding by default, whose global index grows with every answer), each
request with its own sampling parameters and K, and a fifth of the clients going away mid-stream.

It checks, and writes to --out:
- nothing lost: every request that was not dropped ends with a finish reason and its usage, and the
  server's own counters (/metrics: finished requests by reason, aborts included) add up to what was
  sent;
- no KV block leaked: once idle, every pool's free blocks are what they were before the first request;
- memory flat after warm-up: the server's RSS (sampled from /proc) grows by under 5% from the end of
  the first minute to the end;
- steady latency: TPOT p99 of the requests that finished in the last minute within 10% of those in
  the first.

example:
  python -m benchmarks.soak --minutes 10 --rate 1.5 --out bench_results/soak_cpu.json
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

from benchmarks import serve_side_by_side
from nanospec.bench_serve import Client, percentiles
from nanospec.prompts import read_prompts_file, shipped_prompts

SAMPLING = [   # the sampling fields a request takes, one of these, each with its own seed
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 20},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 0.6, "repetition_penalty": 1.1},
    {"temperature": 0.9, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    {"temperature": 0, "stop": ["\n\n"]},
]
KS = [None, 0, 1, 2, 4]   # the request's num_speculative_tokens (None: the server's)


def request_body(rng: random.Random, prompt: str, model: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": rng.randint(8, 128), "seed": rng.randrange(1 << 31), **rng.choice(SAMPLING)}
    k = rng.choice(KS)
    if k is not None:
        body["num_speculative_tokens"] = k
    if rng.random() < 0.1:
        body["logprobs"] = True if chat else 2
        if chat:
            body["top_logprobs"] = 2
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def send(port: int, path: str, body: dict, drop_after: int | None) -> dict:
    """Stream one request; drop_after: close the connection after that many chunks (a client that
    goes away). Returns what the client saw."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    seen = {"start": start, "chunks": 0, "finish_reason": None, "usage": None, "dropped": False,
            "status": None, "first": None}
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        seen["status"] = resp.status
        if resp.status != 200:
            seen["error"] = resp.read().decode(errors="replace")[:300]
            return seen
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                seen["usage"] = chunk["usage"]
            for choice in chunk.get("choices", []):
                seen["first"] = seen["first"] or time.perf_counter()
                seen["chunks"] += 1
                seen["finish_reason"] = choice.get("finish_reason") or seen["finish_reason"]
            if drop_after is not None and seen["chunks"] >= drop_after:
                seen["dropped"] = True
                return seen
    except Exception as e:   # a failed request is a finding, recorded
        seen["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
        seen["end"] = time.perf_counter()
    return seen


def get(port: int, path: str) -> str:
    return Client(f"http://127.0.0.1:{port}", None).get(path)


def metric(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus series' samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"nanospec:{name}(?:_total)?(?:{{(.*)}})? (\S+)$", line)   # a counter's _total
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def speculation(text: str) -> dict:
    return {"steps": metric(text, "spec_decode_chosen_k"), "tokens": metric(text, "generation_tokens"),
            "draft_tokens": metric(text, "spec_decode_num_draft_tokens"),
            "accepted_tokens": metric(text, "spec_decode_num_accepted_tokens")}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def start_server(args) -> tuple[subprocess.Popen, int]:
    """The server, up (its /health answers; it fails or gives up after 15 minutes), and its port."""
    port = args.port
    if not port:   # a free one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanospec.serve", "--port", str(port), *args.server_args.split()]
    return serve_side_by_side.start(cmd, port, {}, f"/tmp/soak_server_{port}.log"), port


def settled_metrics(port: int, sent: int, timeout: float = 60) -> str:
    """/metrics once the server's finished requests add up to those sent (a dropped client's abort
    reaches the engine at its next step), or after timeout seconds."""
    deadline = time.perf_counter() + timeout
    while True:
        text = get(port, "/metrics")
        if metric(text, "request_success") >= sent or time.perf_counter() > deadline:
            return text
        time.sleep(0.5)


def tpot(seen: dict) -> float | None:
    tokens = (seen.get("usage") or {}).get("completion_tokens", 0)
    return (seen["end"] - seen["first"]) / (tokens - 1) if tokens > 1 and seen["first"] else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--drop", type=float, default=0.2, help="the share of clients that go away mid-stream")
    ap.add_argument("--server-args", default="--suffix", help="the server's flags (default: --suffix)")
    ap.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="shipped",
                    help="shipped (nanospec's prompts) or a FILE.jsonl of 'prompt's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = ([r["prompt"] for r in shipped_prompts()] if args.dataset == "shipped"
               else read_prompts_file(args.dataset))
    server, port = start_server(args)
    try:
        model = json.loads(get(port, "/v1/models"))["data"][0]["id"]
        before = get(port, "/metrics")
        free_before = {pool: metric(before, "kv_cache_free_blocks", pool=pool)
                       for pool in ("target", "draft")}
        results, threads, rss, spec = [], [], [], []
        lock = threading.Lock()
        start = time.perf_counter()
        end = start + 60 * args.minutes
        next_arrival = start

        def one(path, body, drop_after):
            seen = send(port, path, body, drop_after)
            with lock:
                results.append(seen)
        while True:
            next_arrival += rng.expovariate(args.rate)
            now = time.perf_counter()
            if next_arrival > end:
                break
            if not rss or now - start - rss[-1][0] >= 5:
                rss.append((now - start, rss_bytes(server.pid)))
            if now - start >= 60 * len(spec):   # the speculation counters at each minute's start
                spec.append(speculation(get(port, "/metrics")))
            time.sleep(max(0.0, next_arrival - now))
            path, body = request_body(rng, rng.choice(prompts), model)
            drop_after = rng.randint(1, 6) if rng.random() < args.drop else None
            thread = threading.Thread(target=one, args=(path, body, drop_after), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        rss.append((time.perf_counter() - start, rss_bytes(server.pid)))
        after = settled_metrics(port, metric(before, "request_success") + len(results))
        spec.append(speculation(after))
    finally:
        serve_side_by_side.stop(server)
    report = summarize(args, results, rss, start, before, after, free_before)
    report["speculation_by_minute"] = [   # draft tokens verified and accepted in each minute
        {"minute": m + 1, **{k: b[k] - a[k] for k in a}} for m, (a, b) in enumerate(zip(spec, spec[1:]))]
    print(json.dumps(report["checks"], indent=1))
    for row, spec_row in zip(report["by_minute"], report["speculation_by_minute"]):
        tpot_ms = row["tpot_ms"]
        print(f"minute {row['minute']}: {row['finished']} finished, TPOT p50 {tpot_ms.get('p50', 0):.1f} ms, "
              f"p99 {tpot_ms.get('p99', 0):.1f} ms; {json.dumps(spec_row)}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


def summarize(args, results, rss, start, before, after, free_before) -> dict:
    kept = [s for s in results if not s["dropped"]]
    lost = [s for s in kept if s["status"] != 200 or s["finish_reason"] is None or s["usage"] is None]
    finished = metric(after, "request_success") - metric(before, "request_success")
    aborted = (metric(after, "request_success", finished_reason="abort")
               - metric(before, "request_success", finished_reason="abort"))
    free_after = {pool: metric(after, "kv_cache_free_blocks", pool=pool) for pool in free_before}
    warm = [b for t, b in rss if t >= 60] or [rss[-1][1]]
    minute = lambda lo, hi: [t for s in kept if lo <= s["end"] - start < hi and (t := tpot(s)) is not None]
    span = 60 * args.minutes
    first, last = percentiles(minute(0, 60))["p99"], percentiles(minute(span - 60, span + 3600))["p99"]
    minutes = [{"minute": m + 1, "finished": len(ts := minute(60 * m, 60 * (m + 1))),
                "tpot_ms": {q: 1000 * v for q, v in percentiles(ts).items() if v is not None}}
               for m in range(math.ceil(args.minutes))]
    checks = {
        "requests": len(results), "dropped": len(results) - len(kept), "lost": len(lost),
        "first_lost": lost[0] if lost else None,
        "server_finished": finished, "server_aborted": aborted,
        "counters_add_up": finished == len(results),
        "kv_free_blocks_before_after": {p: [free_before[p], free_after[p]] for p in free_before},
        "no_block_leaked": free_after == free_before,
        "rss_mb_after_warmup_and_end": [warm[0] / 2**20, rss[-1][1] / 2**20],
        "rss_growth": rss[-1][1] / warm[0] - 1,
        "tpot_p99_ms_first_and_last_minute": [1000 * first, 1000 * last] if first and last else None,
        "tpot_p99_last_over_first": last / first if first and last else None,
        "output_tokens": sum((s.get("usage") or {}).get("completion_tokens", 0) for s in kept),
        "tpot_p50_ms": 1000 * statistics.median(t for s in kept if (t := tpot(s)) is not None),
    }
    return {"command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]), "checks": checks,
            "by_minute": minutes,
            # each kept request: [its end (s from the start), output tokens, TPOT ms]
            "requests": [[round(s["end"] - start, 3), (s.get("usage") or {}).get("completion_tokens", 0),
                          round(1000 * t, 2) if (t := tpot(s)) is not None else None] for s in kept],
            "rss": rss, "minutes": args.minutes, "rate": args.rate}


if __name__ == "__main__":
    main()
