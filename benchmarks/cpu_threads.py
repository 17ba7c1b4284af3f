"""Plain decoding tokens/s on this CPU by thread count, on a quiet machine and on a busy one (two
other processes each spinning a core), through the command line as a user runs it: 1 and 2
threads, and the default (one per core that other work leaves free).

    python -m benchmarks.cpu_threads [--max-new-tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Write a short paragraph about the history of the printing press."


def tokens_per_second(threads: str | None, max_new_tokens: int) -> float:
    cmd = [sys.executable, "-m", "nanospec.generate", "--chat", "--prompt", PROMPT, "--max-new-tokens",
           str(max_new_tokens), "--json", "--device", "cpu"] + (["--threads", threads] if threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])["stats"]["tokens_per_second"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens per run (default: 48)")
    args = ap.parse_args()
    result = {"cpu_count": os.cpu_count(), "max_new_tokens": args.max_new_tokens, "tokens_per_s": {}}
    for load in ("quiet", "busy"):
        spinners = [subprocess.Popen([sys.executable, "-c",
                                      "while True: pass"]) for _ in range(2 if load == "busy" else 0)]
        time.sleep(1 if spinners else 0)
        try:
            for threads in ("1", "2", None):
                tps = tokens_per_second(threads, args.max_new_tokens)
                result["tokens_per_s"][f"{load}, {threads or 'default'} threads"] = tps
                print(f"{load}, {threads or 'default'} threads: {tps:.1f} tokens/s", file=sys.stderr)
        finally:
            for p in spinners:
                p.kill()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
