"""The decode step's matrix products alone on a GPU, Llama-3.1-8B's shapes in bfloat16 at a few
rows: each product's time and bytes read per second against the copy bandwidth, through each BLAS
library torch offers (torch.backends.cuda.preferred_blas_library), to see whether a product the
step_anatomy section finds slow is the library's choice of kernel.

    python -m benchmarks.decode_gemms [--rows 1,4,16] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton.testing


from benchmarks.measure import time_copy

SHAPES = {"qkv_proj": (4096, 6144), "o_proj": (4096, 4096), "gate_up_proj": (4096, 28672),
          "down_proj": (14336, 4096), "lm_head": (4096, 128256)}   # (in, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--out")
    args = ap.parse_args()
    bandwidth, rows = time_copy(torch.device("cuda"), 1024)[0], []   # the GPU check's own measure
    for library in ("cublaslt", "cublas"):
        torch.backends.cuda.preferred_blas_library(library)
        for name, (k, n) in SHAPES.items():
            # 2: out of L2
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                turn = iter(range(1 << 30))
                ms = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, weights[next(turn) % 2]),
                                             return_mode="median")
                row = {"library": library, "name": name, "rows": m, "us": round(ms * 1e3, 2),
                       "of_copy_bw": round(n * k * 2 / (ms * 1e-3) / bandwidth, 3)}
                rows.append(row)
                print(f"{library:9} {name:13} rows {m:3}: {row['us']:8.2f} us, {row['of_copy_bw']:.3f} of "
                      "copy bw")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw_gb_s": round(bandwidth / 1e9, 1),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
