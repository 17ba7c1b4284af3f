"""The replay (benchmarks/replay.py): faithful to the engine, and the yardstick dynamic K is held to."""
import random

import pytest

from nanospec import LLM, SamplingParams
from nanospec.dynamic_k import DynamicK, Profile, acceptance_length
from nanospec.errors import NanospecError
from benchmarks.replay import Trace, compare, ngram_trace, replay
from conftest import PROMPTS

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
    draft is accepted with probability `continuation` once the ones before it were, afresh at every
    step: a draft model's acceptance (per-position rates, spans=False), not n-gram's. mixed: half the
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


def text_workload(copy_share: float, mean_span: float, seed: int = 0, requests: int = 48, length: int = 64,
                  max_k: int = 6, mixed: bool = False):
    """What n-gram sees in text: at a token, with probability copy_share, a span the context holds
    (geometric, mean_span tokens), which it drafts right until the span ends, wherever the steps cut
    it; otherwise a token it has not seen, where it drafts something wrong half the time. mixed:
    half the requests copy (copy_share 0.9), half hardly ever (0.02)."""
    rng, traces = random.Random(seed), []
    for r in range(requests):
        share = copy_share if not mixed else (0.9 if r % 2 == 0 else 0.02)
        found, matched = [], []
        while len(found) < length:
            if rng.random() < share:
                span = 1
                while rng.random() < 1 - 1 / mean_span:
                    span += 1
                found += [max_k] * span
                matched += [min(left, max_k) for left in range(span, 0, -1)]
            found.append(max_k if rng.random() < 0.5 else 0)
            matched.append(0)
        traces.append(Trace(length, found[:length], matched[:length]))
    return traces


# A CPU-like clock: a draft costs 1.5% of a batch-1 step to verify, 40% of a batch-16 step's base.
CLOCK = Profile([1, 8, 16], [0, 1, 2, 4, 6], [[0.050, 0.051, 0.052, 0.055, 0.058],
                                              [0.070, 0.090, 0.110, 0.150, 0.190],
                                              [0.100, 0.140, 0.180, 0.260, 0.340]], acceptance=[0.3] * 6)


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("continuation", [0.5, 0.85])
def test_dynamic_k_is_within_3_percent_of_the_best_static_k_where_requests_accept_alike(continuation,
                                                                                        batch_size,
                                                                                        continuous):
    """With a profile that is exactly the clock and requests that accept alike, the goodput of a step
    is the throughput, and the policy (warm-up, online rates, measured step times, probes) keeps up
    with the best K fixed in hindsight, which moves from K = 4-6 at batch 1 to 1-3 at batch 16.
    Draft-model acceptance, per-position rates."""
    result = compare(workload(False, continuation), batch_size, CLOCK, max_tokens=64, continuous=continuous,
                     spans=False)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


@pytest.mark.parametrize("continuous", [True, False])
@pytest.mark.parametrize("batch_size", [1, 4, 16])
@pytest.mark.parametrize("copy_share, mean_span", [(0.2, 4), (0.3, 8), (0.1, 20)])
def test_dynamic_k_keeps_up_with_the_best_static_k_on_text_that_n_gram_copies(copy_share, mean_span,
                                                                              batch_size, continuous):
    """The same for n-gram's acceptance (spans of text, SpanRates): 0.98-1.01 of the best K at batch 4
    and 16. With per-position rates the policy got 0.92-0.985 on these: each K's own steps made it
    look best (see SpanRates)."""
    result = compare(text_workload(copy_share, mean_span), batch_size, CLOCK, max_tokens=64,
                     continuous=continuous)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


class FixedK(DynamicK):
    """K = k at every step, observing what the policy would."""

    def __init__(self, k: int, spans: bool):
        super().__init__(CLOCK, 6, probe_every=0, spans=spans, decay=1.0)
        self.k = k

    def choose(self, requests, queue_size: int = 0) -> list[int]:
        return [self.k] * len(requests)


@pytest.mark.parametrize("copy_share, mean_span", [(0.2, 4), (0.3, 8), (0.1, 20)])
def test_spans_seen_at_one_k_tell_what_every_k_accepts(copy_share, mean_span):
    """Watching K = 6, spans predict the acceptance length of every K = 1..6 within 3% of what a
    replay at that K gets (one request at a time: tokens per step); per-position rates from the same
    steps put K = 1 8-16% low, as they put every K below the one they watched."""
    traces = text_workload(copy_share, mean_span)
    spans, per_position = FixedK(6, spans=True), FixedK(6, spans=False)
    for policy in (spans, per_position):
        replay(traces, 1, policy, ONE_SECOND_A_STEP, max_tokens=64)
    for k in range(1, 7):
        tokens, steps = replay(traces, 1, k, ONE_SECOND_A_STEP, max_tokens=64)
        assert spans.acceptance.acceptance_length(k) == pytest.approx(tokens / steps, rel=0.03)
    tokens, steps = replay(traces, 1, 1, ONE_SECOND_A_STEP, max_tokens=64)
    assert acceptance_length(per_position.acceptance.rates(), 1) < 0.93 * tokens / steps


@pytest.mark.xfail(strict=True,
                   reason="known: per-step goodput over pooled per-position rates overvalues drafts "
                                       "for a mixed batch")
def test_per_position_rates_fall_behind_when_half_the_requests_copy_and_half_do_not():
    """Under continuous batching at batch 16, K = 0 is the best static K here (160 tokens/s against
    153 for K = 1), and dynamic K with per-position rates reaches 0.93 of it. The pooled rates (a_0
    about 0.5) say K >= 1 pays, and for this step's batch it does; but the copying requests it speeds
    up leave sooner, so the batch fills with requests that accept nothing, and over the run the
    drafts cost more than they gain. Per-position rates count steps, and the K chosen shapes which
    requests the steps are; per-request K (below), or rates weighted by text as spans are (next
    test), see it. A fix for draft-model acceptance turns this test into a pass."""
    result = compare(workload(True), 16, CLOCK, max_tokens=64, continuous=True, spans=False)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


@pytest.mark.parametrize("batch_size", [4, 16])
def test_spans_keep_up_when_half_the_requests_copy_and_half_do_not(batch_size):
    """n-gram on the mix: spans are counted per stretch of text, not per step, so the copying
    requests weigh what their text weighs whatever K does to their steps (0.985 of the best static
    K at batch 16, where per-position rates got 0.94)."""
    result = compare(text_workload(0, 10, mixed=True), batch_size, CLOCK, max_tokens=64, continuous=True)
    assert result["dynamic_over_best"] >= 0.97, result["tokens_per_s"]


@pytest.mark.parametrize("spans", [False, True])
@pytest.mark.parametrize("batch_size", [4, 16])
def test_per_request_k_beats_every_static_k_when_half_the_requests_copy(batch_size, spans):
    """Drafts where they are accepted: the copying requests get a large K, the others none, which no
    one K can do (1.13 and 1.11 of the best static K at batch 4 and 16 with draft-model acceptance,
    1.07 and 1.04 with n-gram's)."""
    traces = text_workload(0, 10, mixed=True) if spans else workload(True)
    result = compare(traces, batch_size, CLOCK, max_tokens=64, continuous=True, per_request=True, spans=spans)
    assert result["dynamic_over_best"] >= (1.03 if spans else 1.05), result["tokens_per_s"]


def test_replay_command_records_a_workload_and_prints_every_row(checkpoints, tmp_path, capsys):
    from benchmarks.replay import main
    profile = tmp_path / "profile.json"
    Profile([1, 2], [0, 1, 2], [[0.01, 0.011, 0.012], [0.02, 0.025, 0.03]],
            acceptance=[0.5, 0.3]).save(str(profile))
    args = ["--profile", str(profile), "--target", checkpoints["qwen3"], "--categories", "code_edit",
            "--batch-sizes", "1,2", "--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32"]
    assert main(args + ["--max-k", "2", "--continuous"]) == 0
    out = capsys.readouterr().out
    assert "continuous" in out and out.count("dynamic / best") == 2 and "K=2:" in out
    for bad, message in ((["--max-k", "4"], "--max-k must be in 1..2"),
                         (["--max-k", "0"], "--max-k must be in 1..2"),
                         (["--max-k", "2", "--num-requests", "-1"], "--num-requests must be >= 0"),
                         (["--max-k", "2", "--batch-sizes", "0,2"], "--batch-sizes takes batch sizes >= 1")):
        assert main(args + bad) == 2
        assert message in capsys.readouterr().err


def test_replay_rejects_an_empty_batch_instead_of_looping():
    with pytest.raises(NanospecError, match="batch size must be >= 1"):
        replay(workload(False, requests=2), 0, 2, CLOCK, max_tokens=64)
