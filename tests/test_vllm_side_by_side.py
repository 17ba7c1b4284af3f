"""benchmarks/vllm_side_by_side.py's interleaved rounds, with nanospec alone on a tiny checkpoint (vLLM is
not installed beside the tests): the worker kept up answers each row it is sent, and the rounds'
ratios pair each round's runs of a row."""
from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import vllm_side_by_side as side


@pytest.mark.slow
def test_interleaved_rounds_keep_one_worker_up_and_time_every_row(checkpoints, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[5 + i % 7, 9, 11 + i] for i in range(32)]))
    monkeypatch.setattr(side, "settle", lambda: None)
    monkeypatch.setattr(side, "memory_bandwidth", lambda: 30.0)
    args = argparse.Namespace(model=checkpoints["llama3"], vllm_python="", rounds=2, max_tokens=3, threads=1,
                              modes="plain", sampling="", engines="nanospec", dtype="float32")
    rows, bandwidths = side.interleaved_rounds(args, str(prompts))
    names = [*side.BATCHES, side.DECODE_ROW]
    assert [(r["round"], r["batch"]) for r in rows] == [(n, name) for n in (1, 2) for name in names]
    tokens = {r["batch"]: r["tokens"] for r in rows if r["batch"] != side.DECODE_ROW}
    assert tokens == {"one at a time": 8 * 3, "8 at once": 8 * 3, "32 at once": 32 * 3}
    assert all(r["step_ms"] > 0 for r in rows if r["batch"] == side.DECODE_ROW)
    assert bandwidths == [30.0] * len(rows)


def test_each_rounds_ratio_pairs_that_rounds_runs():
    rows = [{"round": n, "engine": engine, "mode": "plain", "batch": "8 at once", "tokens_per_s": speed}
            for n, engine, speed in ((1, "nanospec", 100.0), (1, "vllm", 50.0), (2, "nanospec", 90.0),
                                     (2, "vllm", 90.0), (3, "nanospec", 120.0), (3, "vllm", 100.0))]
    (row,) = side.best(rows)
    assert row["ratio"] == round(120 / 100, 3)             # the best of each, whichever rounds
    assert row["ratios_by_round"] == [2.0, 1.0, 1.2]
    assert row["median_ratio"] == 1.2
