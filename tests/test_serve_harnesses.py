"""The serving harnesses run as a user runs them, on a tiny checkpoint: benchmarks.serve_overhead's two
modes do the same work on the same prompts, and a short benchmarks.soak finds nothing lost and no
block leaked on a real server process."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from benchmarks import serve_overhead, soak  # noqa: E402 (imports the server: after the skips)
from nanospec import LLM  # noqa: E402

PROMPTS = ["hello there", "a b c d", "tell me a story", "one two three"]


@pytest.mark.slow
def test_serve_overhead_runs_both_modes_on_the_same_work(checkpoints):
    llm = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=2)
    timer = serve_overhead.StepTimer(llm.engine)
    offline = serve_overhead.offline(llm, timer, PROMPTS, 2, 6)
    served = serve_overhead.served(llm, timer, PROMPTS, 2, 6, max_num_seqs=2)
    assert served["failed"] == 0
    assert offline["output_tokens"] == served["output_tokens"] == len(PROMPTS) * 6
    assert served["steps"] >= offline["steps"] > 0 and timer.steps == offline["steps"] + served["steps"]
    assert served["steps_s"] > 0 and served["loop_s"] >= 0
    assert set(served["cpu_s"]) == {"engine_loop", "http", "others", "client"}
    # the threads were found (uvicorn's may use under one clock tick of CPU on a small load: 0.0)
    assert served["http_thread_found"] and served["cpu_s"]["http"] >= 0 and served["cpu_s"]["client"] > 0


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_leaks_no_block(checkpoints, tmp_path):
    dataset, out = tmp_path / "prompts.jsonl", tmp_path / "soak.json"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    soak.main(["--minutes", "0.1", "--rate", "4", "--dataset", str(dataset), "--out", str(out),
               "--server-args", f"--target {checkpoints['qwen3']} --suffix"])
    checks = json.loads(out.read_text())["checks"]
    assert checks["requests"] > 5 and checks["dropped"] > 0   # some clients went away mid-stream
    assert checks["lost"] == 0, checks["first_lost"]
    assert checks["counters_add_up"]
    assert checks["no_block_leaked"]


def test_the_closed_loop_serves_every_request_with_and_without_mixed_steps(checkpoints):
    """benchmarks/mixed_step_itl: 2C requests, each its full length, each gap counted once."""
    from benchmarks import mixed_step_itl
    llm = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=8,
              max_num_batched_tokens=64)
    llm.engine.scheduler.decode_between_prefills = True
    for mixed in (0, 8):
        llm.engine.scheduler.mixed_prefill_tokens = mixed
        figures = mixed_step_itl.closed_loop(llm, 3, 5)
        assert figures["requests"] == 6 and figures["output_tokens"] == 6 * 5
        assert 0 < figures["itl_p50"] <= figures["itl_p99"] and figures["tpot_p50"] > 0
        assert not llm.engine.scheduler.has_work()
