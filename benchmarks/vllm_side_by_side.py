"""Offline tokens/s of nanospec and vLLM on one model, prompts and machine, alternated: plain and
n-gram K=4 decoding, both in float32 (or --dtype bfloat16), greedy (or sampled alike, --sampling), the
same prompt ids (the shipped prompts, a category at a time in turn, in the checkpoint's chat template),
one request at a time (8 prompts) and 8 and 32 at once, 64 tokens each (EOS ignored).

Each (engine, mode) runs in a process of its own that builds its engine once, warms it up and runs
every batch row; the driver runs them in turn, nanospec then vLLM, `--rounds` times, so that a slow
minute of a shared machine falls on both. With --interleave both engines of a mode stay up and take
turns row by row instead (the first to go alternating from round to round): the two runs of a row
are seconds apart, not minutes. Each round's ratio of a row is listed, and their median. Between
runs it measures the machine's memory bandwidth (a float32 sum over 256 MB, median of 9) for the
roofline: bandwidth / the bytes of weights a step reads is the most tokens/s a batch-1 decode step
can reach; nanospec's plain decode step at batch 1 (prefill excluded) and its end-to-end batch-1 row
are given as fractions of it.
Writes one JSON with every row, the best of each and the command.

example (vLLM's CPU build in a venv of its own serving an HF folder: README's "Measured against vLLM"):
  python -m benchmarks.vllm_side_by_side --model /tmp/vllm/smollm2 --vllm-python /tmp/vllm/venv/bin/python \\
      --out bench_results/vllm_side_by_side_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DECODE_ROW = "decode steps at batch 1"   # nanospec's plain decode step alone (median of 60)
BATCHES = {"one at a time": (8, 1), "8 at once": (8, 8), "32 at once": (32, 32)}   # (prompts, at once)


def time_row(generate, prompt_ids: list[list[int]], name: str) -> dict:
    """One row of BATCHES: its prompts generated `at_once` at a time, timed."""
    count, at_once = BATCHES[name]
    prompts = prompt_ids[:count]
    start = time.perf_counter()
    tokens = sum(sum(generate(prompts[i:i + at_once])) for i in range(0, count, at_once))
    seconds = time.perf_counter() - start
    return {"batch": name, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2)}


def run_rows(generate, prompt_ids: list[list[int]]) -> list[dict]:
    """generate(list of prompt ids) -> generated token counts; timed for every row of BATCHES."""
    generate(prompt_ids[:1])   # warm-up (and vLLM's compiled graphs for a first shape)
    return [time_row(generate, prompt_ids, name) for name in BATCHES]


def nanospec_engine(args):
    """(generate, decode_row): decode_row(prompt_ids) times nanospec's plain decode steps at batch 1
    alone (the roofline's own figure, no prefill), None where the mode is not plain greedy."""
    sys.path.insert(0, ROOT)   # a worker runs this file as a script
    from nanospec import LLM, SamplingParams
    from nanospec.cli import set_threads
    set_threads(args.threads)
    proposer = {"ngram": True, "num_speculative_tokens": 4} if args.mode == "ngram" else {}
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=32, **proposer)
    params = SamplingParams(**sampling(args), max_tokens=args.max_tokens, ignore_eos=True)

    def decode_row(prompt_ids):
        from benchmarks.measure import decoding
        from nanospec.dynamic_k import timed
        requests = decoding(llm.engine, prompt_ids[:1], 300)
        step = statistics.median(timed(llm.device, llm.engine.step)[1] for _ in range(60))
        llm.engine.abort(requests)
        return {"batch": DECODE_ROW, "step_ms": round(step * 1000, 2), "tokens_per_s": round(1 / step, 2)}
    return (lambda ps: [len(o.token_ids) for o in llm.generate(ps, params)],
            decode_row if args.mode == "plain" and not args.sampling else None)


def vllm_engine(args):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = {"speculative_config": NGRAM} if args.mode == "ngram" else {}
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=32, seed=0, **spec)
    params = SamplingParams(**sampling(args), max_tokens=args.max_tokens, ignore_eos=True)

    def generate(ps):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]
    return generate, None


def worker(args, prompt_ids: list[list[int]]) -> None:
    """Build one engine and time its rows: all of them, once (sequential rounds), or, with --serve,
    each row the driver names on stdin, answered on stdout, until stdin closes (interleaved rounds)."""
    generate, decode_row = (nanospec_engine if args.worker == "nanospec" else vllm_engine)(args)
    if not args.serve:
        rows = run_rows(generate, prompt_ids) + ([decode_row(prompt_ids)] if decode_row else [])
        print("ROWS " + json.dumps(rows), flush=True)
        return
    generate(prompt_ids[:1])   # warm-up, as run_rows
    print("READY", flush=True)
    for line in sys.stdin:   # a row's name, or DECODE_ROW (plain greedy nanospec only)
        name = line.strip()
        row = decode_row(prompt_ids) if name == DECODE_ROW else time_row(generate, prompt_ids, name)
        print("ROW " + json.dumps(row), flush=True)


def sampling(args) -> dict:
    """The sampling fields both engines take: greedy, or --sampling's ("temperature=0.7,top_p=0.8,top_k=20";
    no per-request seed, in either engine)."""
    fields = dict(pair.split("=") for pair in args.sampling.split(",")) if args.sampling else {}
    return {"temperature": 0.0, **{k: int(v) if k == "top_k" else float(v) for k, v in fields.items()}}


def memory_bandwidth() -> float:
    """GB/s of a float32 sum over 256 MB (the median of 9, after one warm-up), torch's threads as set."""
    import torch
    data = torch.ones(64 * 2 ** 20)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times[1:]) / 1e9


def weight_bytes(model: str, element_size: int = 4) -> int:
    """Bytes of the weights a decode step reads: every tensor of the checkpoint once (tied
    embeddings are stored once; the embedding's rows read per step are negligible, the LM head's
    full read of the same matrix is counted)."""
    from safetensors import safe_open
    total = 0
    for name in os.listdir(model):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    count = 1
                    for d in part.get_shape():
                        count *= d
                    total += count * element_size   # in the dtype run
    return total


def prompt_ids(model: str) -> list[list[int]]:
    """The shipped prompts taken a category at a time in turn (the first 8: one of each category),
    in the checkpoint's chat template."""
    from nanospec.prompts import by_category_in_turn, shipped_prompts
    from nanospec.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}])
            for row in by_category_in_turn(shipped_prompts())[:32]]


def best(rows: list[dict]) -> list[dict]:
    """The best tokens/s of each (engine, mode, batch) over the rounds, and nanospec / vLLM; with
    each round's own ratio (both engines' runs of a row in that round) and their median."""
    tops, by_round = {}, {}
    for r in rows:
        key = (r["engine"], r["mode"], r["batch"])
        tops[key] = max(tops.get(key, 0), r["tokens_per_s"])
        by_round[(*key, r["round"])] = r["tokens_per_s"]
    out = []
    for mode in ("plain", "ngram"):
        for batch in BATCHES:
            ours, theirs = tops.get(("nanospec", mode, batch)), tops.get(("vllm", mode, batch))
            if ours and theirs:
                rounds = sorted({k[3] for k in by_round if k[1:3] == (mode, batch)})
                pairs = [(by_round.get(("nanospec", mode, batch, n)), by_round.get(("vllm", mode, batch, n)))
                         for n in rounds]
                ratios = [round(a / b, 3) for a, b in pairs if a and b]
                out.append({"mode": mode, "batch": batch, "nanospec": ours, "vllm": theirs,
                            "ratio": round(ours / theirs, 3), "ratios_by_round": ratios,
                            "median_ratio": round(statistics.median(ratios), 3)})
    return out


def worker_command(args, engine: str, mode: str, prompts_file: str, serve: bool = False) -> list[str]:
    python = sys.executable if engine == "nanospec" else args.vllm_python
    return [python, os.path.abspath(__file__), "--model", args.model, "--worker", engine, "--mode", mode,
            "--prompts", prompts_file, "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
            "--sampling", args.sampling, "--dtype", args.dtype, *(["--serve"] if serve else [])]


WORKER_ENV = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_CPU_KVCACHE_SPACE": "2"}


def sequential_rounds(args, prompts_file: str) -> tuple[list[dict], list[float]]:
    """Each (engine, mode) a process that builds its engine and runs every row, nanospec then vLLM,
    `--rounds` times."""
    rows, bandwidths = [], []
    for round_ in range(1, args.rounds + 1):
        for mode in args.modes.split(","):
            for engine in args.engines.split(","):
                bandwidths.append(memory_bandwidth())
                start = time.perf_counter()
                done = subprocess.run(worker_command(args, engine, mode, prompts_file), capture_output=True,
                                      text=True, env=WORKER_ENV)
                lines = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
                if done.returncode or not lines:
                    sys.exit(f"{engine} {mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                for row in json.loads(lines[-1][5:]):
                    rows.append({"round": round_, "engine": engine, "mode": mode, **row})
                    print(json.dumps(rows[-1]), flush=True)
                print(f"# {engine} {mode}: {time.perf_counter() - start:.0f} s in all", flush=True)
    return rows, bandwidths


def interleaved_rounds(args, prompts_file: str) -> tuple[list[dict], list[float]]:
    """For each mode, both engines built once in processes of their own and kept; then row by row
    each engine in turn (the first to go alternating from round to round), so that the machine's
    drift from minute to minute falls on both engines' runs of a row alike. An engine waits idle on
    its stdin while the other runs."""
    rows, bandwidths = [], []
    engines = args.engines.split(",")
    for mode in args.modes.split(","):
        workers = {engine: start_worker(args, engine, mode, prompts_file) for engine in engines}
        settle()
        decode = mode == "plain" and not args.sampling and "nanospec" in workers
        for round_ in range(1, args.rounds + 1):
            for name in [*BATCHES, *([DECODE_ROW] if decode else [])]:
                bandwidths.append(memory_bandwidth())
                for engine in (engines if round_ % 2 else engines[::-1]):
                    if name == DECODE_ROW and engine != "nanospec":
                        continue
                    proc, err = workers[engine]
                    proc.stdin.write(name + "\n")
                    proc.stdin.flush()
                    # (vLLM logs to stdout)
                    line = next((out for out in proc.stdout if out.startswith("ROW ")), "")
                    if not line:
                        sys.exit(f"{engine} {mode} stopped at row {name!r} "
                                 f"(exit {proc.wait()}):\n{tail(err)}")
                    rows.append({"round": round_, "engine": engine, "mode": mode, **json.loads(line[4:])})
                    print(json.dumps(rows[-1]), flush=True)
        for proc, err in workers.values():
            proc.stdin.close()
            proc.wait()
            err.close()
    return rows, bandwidths


def start_worker(args, engine: str, mode: str, prompts_file: str):
    """(process, its stderr file): an engine built, warmed up and waiting for rows (one start at a
    time: a build is not timed, but vLLM's is heavy)."""
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(worker_command(args, engine, mode, prompts_file, serve=True),
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err, text=True, env=WORKER_ENV)
    for line in proc.stdout:   # whatever an engine prints while it starts, then READY
        if line.strip() == "READY":
            return proc, err
    sys.exit(f"{engine} {mode} did not start (exit {proc.wait()}):\n{tail(err)}")


def settle(most_seconds: float = 120) -> None:
    """Wait until the machine is quiet (an engine's start may leave work going on behind it, such as
    vLLM's compile workers) before the first timed row."""
    from nanospec.cli import busy_cores
    start = time.perf_counter()
    while busy_cores(1.0) > 0.2 and time.perf_counter() - start < most_seconds:
        pass
    print(f"# engines up; the machine quiet after {time.perf_counter() - start:.0f} s", flush=True)


def tail(err) -> str:
    err.seek(0)
    return err.read()[-3000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF folder both engines load")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines'")
    ap.add_argument("--vllm-python", default="/tmp/vllm/venv/bin/python", help="the python of vLLM's venv")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--interleave", action="store_true",
                    help="keep both engines up and alternate them row by row (see interleaved_rounds)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="nanospec's torch threads (default: 2)")
    ap.add_argument("--modes", default="plain,ngram")
    ap.add_argument("--sampling", default="",
                    help='sampled instead of greedy, e.g. "temperature=0.7,top_p=0.8,top_k=20"')
    ap.add_argument("--engines", default="nanospec,vllm")
    ap.add_argument("--out", help="write the JSON here")
    ap.add_argument("--worker", choices=["nanospec", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["plain", "ngram"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        with open(args.prompts) as f:
            worker(args, json.load(f))
        return

    import torch
    torch.set_num_threads(args.threads)
    ids = prompt_ids(args.model)
    prompts_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(ids, prompts_file)
    prompts_file.close()
    rows, bandwidths = (interleaved_rounds if args.interleave else sequential_rounds)(args, prompts_file.name)
    os.unlink(prompts_file.name)
    element_size = 4 if args.dtype == "float32" else 2
    bandwidth, weights = statistics.median(bandwidths), weight_bytes(args.model, element_size)
    roofline = bandwidth * 1e9 / weights

    def nanospec_plain(batch):
        return max((r["tokens_per_s"] for r in rows if r["engine"] == "nanospec" and r["mode"] == "plain"
                    and r["batch"] == batch), default=None)
    end_to_end, decode = nanospec_plain("one at a time"), nanospec_plain(DECODE_ROW)
    from benchmarks.measure import cpu_flags   # the CPU's kind decides who leads
    report = {
        "what": __doc__.splitlines()[0], "command": " ".join(["python", *sys.argv]),
        "sampling": sampling(args), "dtype": args.dtype, "torch": torch.__version__, "threads": args.threads,
        "cpu_flags": cpu_flags(), "memory_bandwidth_gb_s": round(bandwidth, 1),
        "bandwidths_gb_s": [round(b, 1) for b in bandwidths], "weight_bytes": weights,
        "roofline_tokens_per_s": round(roofline, 1),
        "nanospec_plain_batch1_decode_tokens_per_s": decode,
        "roofline_fraction_batch1_decode_steps": decode and round(decode / roofline, 3),
        "roofline_fraction_batch1_end_to_end": end_to_end and round(end_to_end / roofline, 3),
        "best": best(rows), "rows": rows}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
