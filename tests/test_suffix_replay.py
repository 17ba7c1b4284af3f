"""The suffix replay (benchmarks/suffix_replay.py): faithful to the engine, so that the draft-length
rules it compares are judged on what the engine would do."""
import sys
import types

import pytest

from nanospec import LLM, SamplingParams
from benchmarks.suffix_replay import replay
from conftest import PROMPTS


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 3])
def test_the_replay_steps_the_workload_as_the_engine_does(spec_models, offset):
    """Requests one at a time through the engine (suffix decoding, its extra tokens always drafted
    where the replay does not price them: K = 16 at most L + offset) and the replay of their greedy
    outputs take the same decode steps, so give the same acceptance length."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
              suffix_max_spec_offset=offset, num_speculative_tokens=16, max_num_seqs=1)
    llm.engine.proposer.extras = None   # every extra token drafted, as the replay's unpriced row
    params = SamplingParams(temperature=0, max_tokens=24)
    trace, steps = [], 0
    for p in PROMPTS * 2:   # twice: the second round drafts from the global index too
        prompt = llm.encode_prompt(p)
        out = llm.generate([prompt], params)[0]
        steps += llm.stats["steps"]   # this call's decode steps
        trace.append(dict(category="any", prompt=prompt, output=out.token_ids))
    row = replay(trace, f"suffix+{offset}", cost=0.0)
    generated = sum(len(t["output"]) for t in trace)
    assert row["mean_acceptance_length"] == round(generated / steps, 3)


def test_the_gating_options_gate():
    """suffix+N@pP and @mM rows: a path probability no draft reaches, or a match longer than the
    deepest suffix matched, drafts nothing; @m1 is the default rule."""
    repeated = [5, 9, 2, 7, 3, 8, 1, 6]
    trace = [dict(category="any", prompt=repeated * 3, output=repeated * 2)] * 2
    default = replay(trace, "suffix+0", cost=0.1)
    assert default["drafted_per_step"] > 1 and default["mean_acceptance_length"] > 2
    assert replay(trace, "suffix+0@m1", cost=0.1) == {**default, "row": "suffix+0@m1"}
    for gated in ("suffix+0@p1.01", "suffix+0@m25", "suffix+3 priced@p1.01"):
        row = replay(trace, gated, cost=0.1)
        assert row["drafted_per_step"] == 0 and row["mean_acceptance_length"] == 1, row


def test_the_arctic_row_feeds_arctic_inference_as_vllms_proposer_does(monkeypatch):
    """ArcticInference is no dependency: a stand-in for its SuffixDecodingCache records the calls. A
    request starts with its prompt, each draft follows the tokens added since the last (never twice),
    taken from the last 24 tokens at K 16, and a finished request is stopped with all of its tokens."""
    calls = []

    class Cache:
        def __init__(self, max_tree_depth, max_cached_requests):
            calls.append(("init", max_tree_depth, max_cached_requests))

        def start_request(self, rid, prompt):
            calls.append(("start", rid, list(prompt)))

        def add_active_response(self, rid, tokens):
            calls.append(("add", rid, list(tokens)))

        def speculate(self, rid, context, max_spec_tokens, max_spec_factor, min_token_prob):
            assert (max_spec_factor, min_token_prob) == (1.0, 0.1)   # ArcticInference's defaults, vLLM's too
            calls.append(("speculate", rid, len(context), max_spec_tokens))
            return types.SimpleNamespace(token_ids=[])

        def stop_request(self, rid):
            calls.append(("stop", rid))

    module = types.ModuleType("arctic_inference.suffix_decoding")
    module.SuffixDecodingCache = Cache
    monkeypatch.setitem(sys.modules, "arctic_inference", types.ModuleType("arctic_inference"))
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", module)
    prompt = list(range(30))
    row = replay([dict(category="any", prompt=prompt, output=[100, 101, 102])], "arctic", cost=0.1)
    assert row["mean_acceptance_length"] == 1   # nothing drafted: one token a step
    assert calls == [("init", 24, 10000), ("start", 0, prompt), ("speculate", 0, 24, 16),
                     ("add", 0, [100]), ("speculate", 0, 24, 16), ("add", 0, [101]), ("speculate", 0, 24, 16),
                     ("add", 0, [102]), ("stop", 0)]
