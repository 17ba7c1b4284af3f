"""Benchmark an OpenAI-compatible server (nanospec's, vLLM's, any): send N prompts at a request
rate (Poisson arrivals) or at a fixed concurrency, stream every answer, and measure what vLLM's
`bench serve` measures: TTFT (to the first chunk with text), TPOT ((latency - TTFT) / (output
tokens - 1), per request), ITL (between two chunks with text: a speculative step's several tokens
are one chunk), end-to-end latency, request and output-token throughput; output tokens are the
server's own count (usage, asked for with stream_options.include_usage). Where the server's
/metrics has speculative-decoding counters (vllm:spec_decode_* or nanospec:spec_decode_*), their
change over the run gives the acceptance length. Prints a table; --out writes JSON with the command.

--dataset multiturn: sessions of --turns turns (multiturn_sessions, from the shipped prompts),
each later turn the conversation so far with the server's own answers and a follow-up, sent when the
answer before it has come; --num-prompts sessions, --max-concurrency of them in flight (default:
all). TTFT is also reported per turn: a later turn's prompt begins with the turn before it, which a
server with prefix caching has cached.

example:
  python -m nanospec.bench serve --base-url http://127.0.0.1:8000 --num-prompts 16 --max-concurrency 4
  python -m nanospec.bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 --request-rate 2 \\
      --out rate2.json
  python -m nanospec.bench serve --base-url http://127.0.0.1:8000 --dataset multiturn --num-prompts 8 \\
      --max-concurrency 4

--sweep LABEL=URL ...: several servers (a row each: nanospec with and without speculation, vLLM) at
each load of --concurrencies and --request-rates, the servers measured in turn (their order rotated
each round), --rounds times; writes the JSON (every round, and each figure's median over the rounds)
and beside it a PNG of output throughput, TPOT p50 and TPOT p99 against concurrency and request rate
(matplotlib: pip install 'nanospec[plot]'):
  python -m nanospec.bench serve --sweep plain=http://127.0.0.1:8001 k4=http://127.0.0.1:8002 \\
      --concurrencies 1,4,16,32 --request-rates 1,4 --rounds 3 --out sweep.json
"""
from __future__ import annotations

import functools
import http.client
import itertools
import json
import math
import random
import re
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

from nanospec.cli import log, parser
from nanospec.errors import NanospecError, run_command
from nanospec.prompts import by_category_in_turn, read_prompts_file, shipped_prompts


# ---- the multi-turn workload -------------------------------------------------------------------------------
# Sessions of several turns in which later requests revisit what earlier
# ones produced, as agents and chats do (the same code edited again, the same data in another shape,
# a conversation continued), built from the shipped prompts and the target's own answers, so it
# needs no download. A session's first turn is a shipped prompt; each later turn is the whole
# conversation so far (in the checkpoint's chat template) and a follow-up of the prompt's category.
# Sessions of one category share their follow-ups, as an agent's tasks share their scaffolding.
#
# Every proposer decodes greedily to the same answers, so every one of them runs the same requests
# (benchmarks/proposers.py runs them offline).

def follow_ups() -> dict[str, list[str]]:
    """category -> its two follow-up turns (nanospec/data/follow_ups.jsonl, beside the shipped prompts)."""
    text = resources.files("nanospec").joinpath("data/follow_ups.jsonl").read_text()
    return {row["category"]: row["follow_ups"] for row in map(json.loads, text.splitlines())}


@dataclass(slots=True)
class Session:
    category: str
    turns: list[str]                                   # the user's messages, in order
    answers: list[str] = field(default_factory=list)   # the target's answers so far

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.turns)

    def messages(self) -> list[dict]:
        """The conversation up to the next turn's user message."""
        said = zip(self.turns, self.answers + [None])   # (user, answer) pairs; the next turn's answer None
        return [{"role": role, "content": text} for turn in said
                for role, text in zip(("user", "assistant"), turn) if text is not None]


def multiturn_sessions(rows: list[dict], turns: int = 3) -> list[Session]:
    """A session per shipped prompt row ({"prompt", "category"}): the prompt, then turns - 1 follow-ups."""
    follow = follow_ups()
    return [Session(row["category"], [row["prompt"]] + follow[row["category"]][:turns - 1]) for row in rows]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)   # when each chunk of tokens came
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""                # the answer
    turn: int = 1                 # multiturn: which turn of its session


def build_parser():
    ap = parser("python -m nanospec.bench serve", __doc__)
    ap.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--sweep", nargs="+", metavar="LABEL=URL", help="servers to sweep (see above)")
    ap.add_argument("--concurrencies", default="1,4,16,32", metavar="C,..", help="the sweep's concurrencies")
    ap.add_argument("--request-rates", default="1,4", metavar="R,..",
                    help="the sweep's request rates (requests/s; empty: none)")
    ap.add_argument("--rounds", type=int, default=1, help="the sweep's rounds (medians over them)")
    ap.add_argument("--pause", type=float, default=2.0, metavar="S",
                    help="seconds between the sweep's measurements (vLLM's CPU worker stays busy about a "
                         "second after its last request, which would fall on the next server)")
    ap.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--dataset", default="shipped",
                    help="shipped (nanospec's prompts), multiturn (sessions of --turns turns) or a "
                         "FILE.jsonl of 'prompt's")
    ap.add_argument("--num-prompts", type=int, default=16, metavar="N",
                    help="requests to send (prompts cycle); with --dataset multiturn, sessions")
    ap.add_argument("--turns", type=int, default=3, metavar="T",
                    help="turns a session, 1..3 (--dataset multiturn)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                      help="requests per second, Poisson arrivals (default: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None, metavar="C",
                      help="requests in flight at most")
    ap.add_argument("--max-tokens", type=int, default=64, metavar="N", help="max_tokens of every request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="chat: the prompt as one user message, in the server's chat template")
    ap.add_argument("--extra-body", default="{}", metavar="JSON",
                    help='more request fields, e.g. \'{"ignore_eos": true}\'')
    ap.add_argument("--seed", type=int, default=0, help="the arrival times' seed")
    ap.add_argument("--label", default="", help="a name for this run in the table and JSON")
    ap.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    return ap


def load_prompts(dataset: str, n: int) -> list[str]:
    prompts = [r["prompt"] for r in shipped_prompts()] if dataset == "shipped" else read_prompts_file(dataset)
    return [prompts[i % len(prompts)] for i in range(n)]


class Client:
    """Plain HTTP/1.1 with one connection per request (http.client: no dependency)."""

    def __init__(self, base_url: str, api_key: str | None):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise NanospecError(f"--base-url must be http://HOST:PORT, got {base_url!r}")
        self.url, self.path = url, url.path.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def connect(self, timeout: float = 600):
        kind = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
        return kind(self.url.hostname, self.url.port, timeout=timeout)

    def get(self, path: str) -> str:
        conn = self.connect(30)
        try:
            conn.request("GET", self.path + path, headers=self.headers)
            response = conn.getresponse()
            body = response.read().decode()
            if response.status != 200:
                raise NanospecError(f"GET {path}: {response.status} {body[:200]}")
            return body
        except OSError as e:
            raise NanospecError(f"cannot reach {self.url.geturl()} ({e}); is the server up?") from None
        finally:
            conn.close()

    def stream(self, endpoint: str, body: dict) -> Result:
        result, conn = Result(start=time.perf_counter()), self.connect()
        path = self.path + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
        try:
            conn.request("POST", path, body=json.dumps(body), headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                result.error = f"{response.status} {response.read().decode()[:200]}"
                return result
            for line in response:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                self.take(json.loads(data), result, endpoint)
            result.ok = result.error == "" and result.latency is not None
        except (OSError, ValueError) as e:
            result.error = repr(e)
        finally:
            conn.close()
        return result

    @staticmethod
    def take(chunk: dict, result: Result, endpoint: str) -> None:
        now = time.perf_counter()
        if "error" in chunk:
            result.error = str(chunk["error"].get("message"))
        if chunk.get("usage"):
            result.output_tokens = chunk["usage"].get("completion_tokens") or 0
            result.prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if endpoint == "chat" and "role" in delta:   # chat's opening chunk, before the first token's
                continue
            # a chunk is a step's tokens arriving, its text "" or not (vLLM's client times them so)
            result.text += (delta.get("content") if endpoint == "chat" else choice.get("text")) or ""
            result.chunk_times.append(now)
            result.latency = now - result.start
            if result.ttft is None:
                result.ttft = result.latency


def spec_counters(client: Client) -> dict:
    """The speculative-decoding counters of the server's /metrics, summed over labels ({} if none)."""
    try:
        text = client.get("/metrics")
    except NanospecError:
        return {}
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:vllm|nanospec):spec_decode_(num_drafts|num_accepted_tokens)_total(?:\{[^}]*\})? "
                     r"(\S+)", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def run_threads(jobs: list, concurrency: int | None,
                arrivals: list[float] | None = None) -> tuple[list, float]:
    """Run the jobs (callables) on threads, at most `concurrency` at once (default: all), job i not
    before arrivals[i] seconds from the start (Poisson arrivals); returns what they returned, in order,
    and the seconds they all took. A job's exception is raised here; on one (or Ctrl-C) the jobs not
    yet started are dropped."""
    start, futures = time.perf_counter(), []
    pool = ThreadPoolExecutor(max(1, concurrency or len(jobs)))
    try:
        for i, job in enumerate(jobs):
            if arrivals:
                time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            futures.append(pool.submit(job))
        results = [future.result() for future in futures]
    finally:
        pool.shutdown(cancel_futures=True)
    return results, time.perf_counter() - start


def run_load(client: Client, endpoint: str, bodies: list[dict], rate: float, concurrency: int | None,
             seed: int) -> tuple[list[Result], float]:
    """Send every body (at Poisson arrival times of `rate`, or keeping `concurrency` in flight);
    returns the results in order and the run's duration."""
    rng = random.Random(seed)   # Poisson arrivals: each one an exponential gap after the last
    arrivals = (list(itertools.accumulate(rng.expovariate(rate) for _ in bodies)) if math.isfinite(rate)
                else None)
    return run_threads([functools.partial(client.stream, endpoint, body) for body in bodies], concurrency,
                       arrivals)


def shipped_sessions(count: int, turns: int, first: int = 0) -> list:
    """`count` multi-turn sessions of the shipped prompts (a category at a time in turn), from the
    first-th on, cycling."""
    rows = by_category_in_turn(shipped_prompts())
    return multiturn_sessions([rows[(first + i) % len(rows)] for i in range(count)], turns)


def run_sessions(client: Client, body: dict, sessions: list,
                 concurrency: int | None) -> tuple[list[Result], float]:
    """Each session's turns one after another (the conversation so far, with the answers the server
    gave), `concurrency` sessions in flight; returns every turn's result and the run's duration."""
    results: list[Result] = []
    lock = threading.Lock()

    def converse(session):
        while not session.done:
            result = client.stream("chat", {**body, "messages": session.messages()})
            result.turn = len(session.answers) + 1
            with lock:
                results.append(result)
            if not result.ok:
                return
            session.answers.append(result.text)
    return results, run_threads([functools.partial(converse, s) for s in sessions], concurrency)[1]


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()   # linear interpolation
    return {"mean": sum(values) / len(values), "p50": p50, "p90": p90, "p99": p99, "max": max(values)}


def summarize(results: list[Result], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
               "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
               "ttft_s": percentiles([r.ttft for r in ok]), "tpot_s": percentiles(tpots),
               "itl_s": percentiles(itls), "e2el_s": percentiles([r.latency for r in ok])}
    turns = sorted({r.turn for r in ok})
    if turns != [1]:
        summary["ttft_s_by_turn"] = {str(t): percentiles([r.ttft for r in ok if r.turn == t]) for t in turns}
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if drafts > 0:
        summary["acceptance_length"] = 1 + (after["num_accepted_tokens"]
                                            - before["num_accepted_tokens"]) / drafts
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def format_row(label: str, s: dict) -> str:
    ms = lambda d, k: f"{1000 * d[k]:8.1f}" if d[k] is not None else "       -"
    al = f"{s['acceptance_length']:.2f}" if "acceptance_length" in s else "-"
    return (f"{label:<28} {s['completed']:>4} {ms(s['ttft_s'], 'p50')} {ms(s['ttft_s'], 'p99')} "
            f"{ms(s['tpot_s'], 'p50')} {ms(s['itl_s'], 'p50')} {ms(s['itl_s'], 'p99')} "
            f"{s['request_throughput']:7.2f} {s['output_throughput']:8.1f} {al:>5}")


HEADER = (f"{'run':<28} {'done':>4} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'req/s':>7} {'tok/s':>8} {'AL':>5}   (times in ms)")


def check_args(args) -> dict:
    """The flags, checked before any request; returns --extra-body, parsed."""
    if bool(args.base_url) == bool(args.sweep):
        raise NanospecError("give --base-url URL (one server) or --sweep LABEL=URL ... (several)"
                            + (", not both" if args.base_url else ""))
    if args.num_prompts < 1:
        raise NanospecError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise NanospecError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise NanospecError(f"--request-rate must be above 0, got {args.request_rate}")
    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        raise NanospecError(f"--extra-body is not JSON ({e.msg}); give an object like '{{\"ignore_eos\": "
                            f"true}}'") from None
    if not isinstance(extra, dict):
        raise NanospecError("--extra-body must be a JSON object")
    if args.dataset == "multiturn" and (args.endpoint != "chat" or math.isfinite(args.request_rate)):
        raise NanospecError("--dataset multiturn sends each session's turns one after another as chat: "
                            "use the chat endpoint and --max-concurrency (sessions in flight), not "
                            "--request-rate")
    if args.dataset == "multiturn" and not 1 <= args.turns <= 3:
        raise NanospecError(f"--turns must be 1..3, got {args.turns}")
    return extra


def request_bodies(args, common: dict, n: int) -> list[dict]:
    """One request body per prompt of the dataset's first n: chat messages or a completion prompt."""
    chat = args.endpoint == "chat"
    return [{**common, **({"messages": [{"role": "user", "content": prompt}]} if chat
                           else {"prompt": prompt})}
            for prompt in load_prompts(args.dataset, n)]


def common_body(args, client: Client, extra: dict) -> dict:
    """The fields every request sends: the model (--model, or the server's first), streaming with usage."""
    model = args.model or json.loads(client.get("/v1/models"))["data"][0]["id"]
    return {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def command_line() -> str:
    argv = sys.argv[2:] if sys.argv[1:2] == ["serve"] else sys.argv[1:]
    return "python -m nanospec.bench serve " + " ".join(argv)


def run(args) -> dict:
    extra = check_args(args)
    if args.sweep:
        return run_sweep(args, extra)
    multiturn = args.dataset == "multiturn"
    client = Client(args.base_url, args.api_key)
    common = common_body(args, client, extra)
    model = common["model"]
    load = f"concurrency {args.max_concurrency}" if args.max_concurrency else f"rate {args.request_rate:g}/s"
    before = spec_counters(client)
    if multiturn:
        sessions = shipped_sessions(args.num_prompts, args.turns)
        log(f"bench serve: {len(sessions)} sessions of {args.turns} turns to {args.base_url} ({model}), "
            f"{load} ...")
        results, duration = run_sessions(client, common, sessions, args.max_concurrency)
    else:
        bodies = request_bodies(args, common, args.num_prompts)
        log(f"bench serve: {len(bodies)} requests to {args.base_url} ({model}), {load} ...")
        results, duration = run_load(client, args.endpoint, bodies, args.request_rate, args.max_concurrency,
                                     args.seed)
    summary = summarize(results, duration, before, spec_counters(client))
    label = args.label or load
    print(HEADER)
    print(format_row(label, summary))
    for turn, ttft in summary.get("ttft_s_by_turn", {}).items():
        print(f"  turn {turn}: TTFT p50 {1000 * ttft['p50']:.1f} ms, p99 {1000 * ttft['p99']:.1f} ms")
    report = {"label": label, "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
              "num_prompts": args.num_prompts,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
              "max_concurrency": args.max_concurrency, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "extra_body": extra, "dataset": args.dataset,
              **({"turns": args.turns} if multiturn else {}), **summary, "command": command_line()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


# ---- the sweep: several servers at several loads, drawn --------------------------------------------------
FIGURES = {"output_throughput": ("output_throughput",), "ttft_p50": ("ttft_s", "p50"),
           "tpot_p50": ("tpot_s", "p50"), "tpot_p99": ("tpot_s", "p99"), "itl_p99": ("itl_s", "p99"),
           "acceptance_length": ("acceptance_length",)}
PLOTTED = [("output_throughput", "output tokens/s", 1), ("tpot_p50", "TPOT p50 (ms)", 1000),
           ("tpot_p99", "TPOT p99 (ms)", 1000)]


def sweep_plan(args) -> tuple[dict[str, str], list[dict]]:
    """The servers {label: url} and the loads ({"concurrency": c} or {"rate": r}) of --sweep, checked."""
    pairs = [re.fullmatch(r"(.+?)=(https?://.*)", s) for s in args.sweep]   # a label may hold '=' (K=4)
    if not all(pairs):
        raise NanospecError(f"--sweep takes LABEL=URL, e.g. plain=http://127.0.0.1:8000; got {args.sweep}")
    servers = dict(p.groups() for p in pairs)
    if len(servers) < len(pairs):
        raise NanospecError(f"--sweep labels must differ, got {[p.group(1) for p in pairs]}")
    if args.max_concurrency is not None or math.isfinite(args.request_rate) or args.dataset == "multiturn":
        raise NanospecError("--sweep sets its loads with --concurrencies and --request-rates (not "
                            "--max-concurrency or --request-rate) and sends single requests (no multiturn)")
    if not args.out or args.rounds < 1:
        raise NanospecError("--sweep needs --out FILE.json (the PNG goes beside it) and --rounds >= 1")
    try:
        loads = ([{"concurrency": int(c)} for c in args.concurrencies.split(",") if c]
                 + [{"rate": float(r)} for r in args.request_rates.split(",") if r])
    except ValueError:
        raise NanospecError(f"--concurrencies and --request-rates take numbers like 1,4,16; got "
                            f"{args.concurrencies!r} and {args.request_rates!r}") from None
    if not loads or not all(v > 0 and math.isfinite(v) for load in loads for v in load.values()):
        raise NanospecError("--concurrencies and --request-rates need at least one load, each above 0")
    try:
        import matplotlib   # noqa: F401  (checked before a sweep of many minutes, not after it)
    except ImportError:
        raise NanospecError("--sweep draws with matplotlib: pip install 'nanospec[plot]'") from None
    return servers, loads


def load_name(load: dict) -> str:
    return f"concurrency {load['concurrency']}" if "concurrency" in load else f"rate {load['rate']:g}/s"


def measure_load(client: Client, args, common: dict, load: dict) -> dict:
    """One server at one load: at least --num-prompts requests, and twice the concurrency."""
    n = max(args.num_prompts, 2 * load.get("concurrency", 0))
    before = spec_counters(client)
    results, duration = run_load(client, args.endpoint, request_bodies(args, common, n),
                                 load.get("rate", math.inf), load.get("concurrency"), args.seed)
    return {"num_prompts": n, **summarize(results, duration, before, spec_counters(client))}


def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds in which every request completed (None where none did:
    a server that failed requests is not plotted as a slow one)."""
    def figure(summary, path):
        for key in path:
            summary = summary.get(key) if isinstance(summary, dict) else None
        return summary
    values = {name: [v for r in rounds if not r["failed"] and (v := figure(r, path)) is not None]
              for name, path in FIGURES.items()}
    return {name: statistics.median(v) if v else None for name, v in values.items()}


def run_sweep(args, extra: dict) -> dict:
    """Every server at every load, in turn, --rounds times: the order rotated each round and reversed
    every other, so that no server keeps its place in a cycle over which a shared machine drifts.
    The JSON is rewritten after each load (a long sweep cut short keeps what it measured); the PNG
    goes beside it at the end."""
    servers, loads = sweep_plan(args)
    clients = {label: Client(url, args.api_key) for label, url in servers.items()}
    commons = {label: common_body(args, client, extra) for label, client in clients.items()}
    labels, rows = list(servers), []
    log(f"bench serve: a sweep of {len(servers)} servers at {len(loads)} loads, {args.rounds} rounds ...")
    print(HEADER)
    report = {"servers": servers, "rounds": args.rounds, "endpoint": args.endpoint, "dataset": args.dataset,
              "max_tokens": args.max_tokens, "temperature": args.temperature, "extra_body": extra,
              "rows": rows, "command": command_line()}
    for load in loads:
        rounds = {label: [] for label in labels}
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in order[::-1] if r % 2 else order:
                time.sleep(args.pause)
                rounds[label].append(measure_load(clients[label], args, commons[label], load))
                print(format_row(f"{label}, {load_name(load)}", rounds[label][-1]), flush=True)
        rows += [{"label": label, **load, "median": medians(rounds[label]), "rounds": rounds[label]}
                 for label in labels]
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    png = re.sub(r"\.json$", "", args.out) + ".png"
    plot_sweep(report, png)
    log(f"wrote {args.out} and {png}")
    return report


def plot_sweep(report: dict, path: str) -> None:
    """Output throughput, TPOT p50 and TPOT p99 (medians over the rounds) against concurrency (top)
    and request rate (below), a line per server."""
    from matplotlib.figure import Figure   # not pyplot: no backend chosen, no figure kept open
    axes_x = [(key, title) for key, title in (("concurrency", "concurrency"), ("rate", "requests/s"))
              if any(key in row for row in report["rows"])]
    fig = Figure(figsize=(5 * len(PLOTTED), 4 * len(axes_x)), layout="tight")
    axes = fig.subplots(len(axes_x), len(PLOTTED), squeeze=False)
    for (key, title), row_axes in zip(axes_x, axes):
        for (name, ylabel, scale), ax in zip(PLOTTED, row_axes):
            for label in report["servers"]:
                points = sorted((row[key], row["median"][name] * scale) for row in report["rows"]
                                if row["label"] == label and key in row and row["median"][name] is not None)
                if points:
                    ax.plot(*zip(*points), marker="o", label=label)
            xs = sorted({row[key] for row in report["rows"] if key in row})
            if key == "concurrency":
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.set(xlabel=title, ylabel=ylabel)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{report['endpoint']}, {report['max_tokens']} tokens a request, medians of "
                 f"{report['rounds']} rounds")
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
