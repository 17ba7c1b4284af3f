"""Why the server steps its engine on the main thread: the time of one small matmul (a SmolLM2 MLP
projection at batch 1, torch's CPU threads = cores) when torch runs it on the main thread, on a
second thread in a process whose main thread never ran torch, and on a second thread after the
main thread did (model loading does). torch's OpenMP runs a team of threads per calling thread;
the third case has two teams on the same cores. Each case runs in a fresh process; the cases
alternate, `--repeats` times.

    python -m benchmarks.torch_thread_teams [--repeats 3] [--out bench_results/torch_thread_teams.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASE = r"""
import sys, threading, time, torch
torch.set_num_threads(int(sys.argv[2]))
w, x = torch.randn(1536, 576), torch.randn(2, 576)
def ms():
    for _ in range(50): w @ x.T
    start = time.perf_counter()
    for _ in range(2000): w @ x.T
    return (time.perf_counter() - start) / 2000 * 1000
if sys.argv[1] == "main thread":
    print(ms())
else:
    if sys.argv[1] == "second thread, after the main thread ran torch":
        ms()
    out = []
    thread = threading.Thread(target=lambda: out.append(ms()))
    thread.start(); thread.join()
    print(out[0])
"""
CASES = ["main thread", "second thread, main thread never ran torch",
         "second thread, after the main thread ran torch"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    times = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for case in CASES:
            out = subprocess.run([sys.executable, "-c", CASE, case, str(threads)], capture_output=True,
                                 text=True, check=True).stdout
            times[case].append(float(out))
    result = {"command": "python -m benchmarks.torch_thread_teams " + " ".join(sys.argv[1:]),
              "torch_threads": threads, "matmul": "(1536 x 576) @ (576 x 2), float32", "ms_per_matmul": times,
              "median_ms": {case: statistics.median(t) for case, t in times.items()}}
    for case, t in result["median_ms"].items():
        print(f"{case:<50} {t:.3f} ms (median of {args.repeats})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
