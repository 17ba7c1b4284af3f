"""Host work and host/device traffic per decode step, at batch 1, 64 and 256: the milliseconds a
step spends in the scheduler, the K policy, packing its host data (cuda_graph.StepGraphs.upload:
sampling parameters, block-table updates, last tokens, n-gram drafts) and planning a draft
model's round (host bookkeeping, with a tiny random model so that the forward does not hide it),
and how many host-to-device copies (tensors built from host data, copies out of the step's host
buffer) and device-to-host reads (.tolist()) a step makes.

    python -m benchmarks.step_costs [--steps 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

import torch

from nanospec import LLM, SamplingParams, cuda_graph, engine as engine_module, proposer as proposer_module
from nanospec.dynamic_k import past_prefill

TIMED = {"scheduler": (engine_module.Scheduler, "schedule"), "policy": (engine_module.Engine, "choose_ks"),
         "input packing": (cuda_graph.StepGraphs, "upload"),
         "round planning": (proposer_module.ModelProposer, "prepare")}


def instrument(totals: collections.Counter, counts: collections.Counter, host_buffer: torch.Tensor):
    """Wrap the timed host functions and count copies in and reads back."""
    undo = []
    for label, (owner, name) in TIMED.items():
        real = getattr(owner, name)

        def timed(*args, real=real, label=label, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
        setattr(owner, name, timed)
        undo.append((owner, name, real))
    host = host_buffer.untyped_storage().data_ptr()
    real_tensor, real_tolist, real_copy = torch.tensor, torch.Tensor.tolist, torch.Tensor.copy_
    torch.tensor = lambda *a, **kw: (counts.update(["host to device"]), real_tensor(*a, **kw))[1]
    torch.Tensor.tolist = lambda self: (counts.update(["device to host"]), real_tolist(self))[1]
    torch.Tensor.copy_ = lambda self, src, *a, **kw: (
        counts.update(["host to device"] if src.untyped_storage().data_ptr() == host else []),
        real_copy(self, src, *a, **kw))[1]
    undo += [(torch, "tensor", real_tensor), (torch.Tensor, "tolist", real_tolist),
             (torch.Tensor, "copy_", real_copy)]
    return undo


def measure(target: str, batch: int, steps: int, proposer: dict) -> dict:
    llm = LLM(target, device="cpu", dtype="float32", max_num_seqs=batch, kv_cache_gb=0.5, **proposer)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps * 8 + 8, ignore_eos=True)
    prompt = llm.encode_prompt("The quick brown fox jumps over the lazy dog. The quick brown fox")
    engine.add_requests([engine.new_request(i, "", prompt, params) for i in range(batch)])
    past_prefill(engine)
    engine.step()   # a warm-up decode step
    totals, counts = collections.Counter(), collections.Counter()
    undo = instrument(totals, counts, engine.step_graphs.host)
    start = time.perf_counter()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for owner, name, real in reversed(undo):
            setattr(owner, name, real)
    seconds = time.perf_counter() - start
    return {"batch": batch,
            "proposer": "ngram" if proposer.get("ngram") else "draft" if proposer.get("draft") else "none",
            "step_ms": round(1000 * seconds / steps, 3),
            **{f"{label}_ms": round(1000 * totals[label] / steps, 3) for label in TIMED},
            **{f"{kind} per step": counts[kind] / steps for kind in ("host to device", "device to host")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="decode steps measured per row (default: 20)")
    ap.add_argument("--out", help="write the rows as JSON there")
    args = ap.parse_args()
    from tests.conftest import write_checkpoint
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = write_checkpoint(os.path.join(tmp, "tiny"), "llama3", num_layers=2, hidden=64)
        for proposer in ({}, {"ngram": True, "num_speculative_tokens": 4},
                         {"draft": target, "num_speculative_tokens": 4}):
            for batch in (1, 64, 256):
                rows.append(measure(target, batch, args.steps, proposer))
                print(json.dumps(rows[-1]), file=sys.stderr)
    result = {"command": "python -m benchmarks.step_costs " + " ".join(sys.argv[1:]),
              "torch": torch.__version__,
              "model": "random llama3, 2 layers, hidden 64, vocab 320 (tests/conftest.py)", "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
