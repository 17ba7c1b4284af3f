"""The replay (nanospec/replay.py): faithful to the engine, and the yardstick dynamic K is held to."""
import random

import pytest

from nanospec import LLM, SamplingParams
from nanospec.dynamic_k import Profile
from nanospec.errors import NanospecError
from nanospec.replay import Trace, compare, ngram_trace, replay
from test_speculative import PROMPTS

ONE_SECOND_A_STEP = Profile([1], [0, 1], [[1.0, 1.0]], acceptance=[0.5])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_replay_steps_the_workload_as_the_engine_does(spec_models, k):
    """The engine's own n-gram run (all prompts in one batch, K drafts a step) and the replay of its
    greedy outputs take the same number of decode steps and emit the same tokens."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, ngram=True,
              num_speculative_tokens=k, max_num_seqs=len(PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = [llm.encode_prompt(p) for p in PROMPTS]
    outputs = llm.generate(prompts, params)
    traces = [ngram_trace(p, o.token_ids, max_k=6) for p, o in zip(prompts, outputs)]
    tokens, steps = replay(traces, len(prompts), k, ONE_SECOND_A_STEP, max_tokens=24)
    assert (tokens, steps) == (llm.stats["generated_tokens"], llm.stats["steps"])


def workload(mixed: bool, continuation: float = 0.7, seed: int = 0, requests: int = 48, length: int = 64):
    """Requests of `length` tokens; where the proposer drafts (6 tokens, 80% of positions), each next
    draft is accepted with probability `continuation` once the ones before it were. mixed: half the
    requests copy their context instead (continuation 0.95) and half write new text (0.05, a draft
    found half the time): the mix where no one K suits every request."""
    rng, traces = random.Random(seed), []
    for r in range(requests):
        p_found, p_next = (0.8, continuation) if not mixed else ((0.9, 0.95) if r % 2 == 0 else (0.5, 0.05))
        found = [6 if rng.random() < p_found else 0 for _ in range(length)]
        matched = []
        for f in found:
            m = 0
            while m < f and rng.random() < p_next:
                m += 1
            matched.append(m)
        traces.append(Trace(length, found, matched))
    return traces


# A CPU-like clock: a draft costs 1.5% of a batch-1 step to verify, 40% of a batch-16 step's base.
CLOCK = Profile([1, 8, 16], [0, 1, 2, 4, 6], [[0.050, 0.051, 0.052, 0.055, 0.058],
                                              [0.070, 0.090, 0.110, 0.150, 0.190],
                                              [0.100, 0.140, 0.180, 0.260, 0.340]], acceptance=[0.3] * 6)


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("continuation", [0.5, 0.85])
def test_dynamic_k_is_within_3_percent_of_the_best_static_k_where_requests_accept_alike(continuation, batch_size,
                                                                                       continuous):
    """With a profile that is exactly the clock and requests that accept alike, the goodput of a step
    is the throughput, and the policy (warm-up, online rates, measured step times, probes) keeps up
    with the best K fixed in hindsight, which moves from K = 4-6 at batch 1 to 1-3 at batch 16."""
    result = compare(workload(False, continuation), batch_size, CLOCK, max_tokens=64, continuous=continuous)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


@pytest.mark.xfail(strict=True, reason="known: per-step goodput over pooled rates overvalues drafts for a mixed batch")
def test_dynamic_k_keeps_up_when_half_the_requests_copy_and_half_do_not():
    """Under continuous batching at batch 16, K = 0 is the best static K here (160 tokens/s against
    153 for K = 1), and dynamic K reaches 0.93 of it. The pooled rates (a_0 about 0.5) say K >= 1
    pays, and for this step's batch it does; but the copying requests it speeds up leave sooner, so
    the batch fills with requests that accept nothing, and over the run the drafts cost more than
    they gain. Goodput per step does not see that the K chosen shapes the batch; per-request K, or
    rates reweighted to the mix of arriving requests, would (next test). A fix turns this test into a pass."""
    result = compare(workload(True), 16, CLOCK, max_tokens=64, continuous=True)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


@pytest.mark.parametrize("batch_size", [4, 16])
def test_per_request_k_beats_every_static_k_when_half_the_requests_copy(batch_size):
    """Drafts where they are accepted: the copying requests get a large K, the others none, which no
    one K can do (1.13 and 1.11 of the best static K at batch 4 and 16 here)."""
    result = compare(workload(True), batch_size, CLOCK, max_tokens=64, continuous=True, per_request=True)
    assert result["dynamic_over_best"] >= 1.05, result["tokens_per_s"]


def test_replay_command_records_a_workload_and_prints_every_row(checkpoints, tmp_path, capsys):
    from nanospec.replay import main
    profile = tmp_path / "profile.json"
    Profile([1, 2], [0, 1, 2], [[0.01, 0.011, 0.012], [0.02, 0.025, 0.03]], acceptance=[0.5, 0.3]).save(str(profile))
    args = ["--profile", str(profile), "--target", checkpoints["qwen3"], "--categories", "code_edit",
            "--batch-sizes", "1,2", "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32"]
    assert main(args + ["--max-k", "2", "--continuous"]) == 0
    out = capsys.readouterr().out
    assert "continuous" in out and out.count("dynamic / best") == 2 and "K=2:" in out
    for bad, message in ((["--max-k", "4"], "--max-k must be in 1..2"), (["--max-k", "0"], "--max-k must be in 1..2"),
                         (["--max-k", "2", "--num-requests", "-1"], "--num-requests must be >= 0"),
                         (["--max-k", "2", "--batch-sizes", "0,2"], "--batch-sizes takes batch sizes >= 1")):
        assert main(args + bad) == 2
        assert message in capsys.readouterr().err


def test_replay_rejects_an_empty_batch_instead_of_looping():
    with pytest.raises(NanospecError, match="batch size must be >= 1"):
        replay(workload(False, requests=2), 0, 2, CLOCK, max_tokens=64)
