"""Speculative decoding is lossless, for every proposer: greedy output equals plain greedy output
token for token, and sampled output has exactly the target's sequence distribution."""
import itertools

import numpy as np
import pytest
import torch

from chisquare import chi_square_pvalue
from nanospec import LLM, SamplingParams, sampler
from test_sampler import reference_probs

PROPOSERS = ["ngram", "draft", "self_draft", "eagle1", "eagle3"]
# Mixed lengths; repetitive ones give the n-gram proposer something to find.
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", "1234567890 numbers",
           "User: hello there!\nAssistant: Hi, how can I help you today?\nUser: hello there!\nAssistant:",
           "It was", "héllo wörld, ça va? héllo", "print(add(1, 2))\nprint(add(1, 2))\nprint(", "The"]


def proposer_args(spec_models, name: str) -> dict:
    return {"ngram": dict(ngram=True), "draft": dict(draft=spec_models["draft"]),
            "self_draft": dict(draft=spec_models["target"]), "eagle1": dict(eagle=spec_models["eagle1"]),
            "eagle3": dict(eagle=spec_models["eagle3"])}[name]


def greedy(max_tokens=20):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_no_leak(llm):
    engine = llm.engine
    assert not engine.scheduler.has_work()
    for pool in [engine.kv_cache] + ([engine.proposer.kv_cache] if hasattr(engine.proposer, "kv_cache") else []):
        assert pool.allocator.num_free == pool.allocator.num_blocks


@pytest.fixture(scope="module")
def plain_greedy(spec_models):
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, greedy()))}


@pytest.mark.parametrize("name", PROPOSERS)
def test_greedy_output_equals_plain_greedy(spec_models, plain_greedy, name):
    """K = 1..8, each with its own batch size (together 1..8), prompts of mixed lengths."""
    for k in range(1, 9):
        batch = PROMPTS[:(3 * k) % 8 + 1]
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
                  num_speculative_tokens=k, **proposer_args(spec_models, name))
        outs = llm.generate(batch, greedy())
        assert [o.token_ids for o in outs] == [plain_greedy[p] for p in batch], f"K={k}"
        assert llm.stats["drafted_tokens"] > 0
        assert_no_leak(llm)
        if name == "self_draft":   # the target as its own draft accepts everything
            assert llm.stats["acceptance_rate_per_position"][0] == 1.0


@pytest.mark.parametrize("name", PROPOSERS)
def test_preemption_changes_nothing(spec_models, plain_greedy, name):
    """20 blocks of 4 tokens hold two or three requests: the scheduler preempts, the proposer releases
    its state and catches up again after the recompute. Greedy and seeded sampled outputs are
    those of plain greedy decoding and of an ample pool."""
    args = dict(device="cpu", dtype="float32", num_speculative_tokens=4, **proposer_args(spec_models, name))
    tiny = LLM(spec_models["target"], block_size=4, num_kv_blocks=20, max_num_batched_tokens=32, **args)
    ample = LLM(spec_models["target"], kv_cache_gb=0.05, **args)
    assert [o.token_ids for o in tiny.generate(PROMPTS, greedy())] == [plain_greedy[p] for p in PROMPTS]
    assert tiny.stats["preemptions"] > 0
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=i, ignore_eos=True) for i in range(8)]
    assert [o.token_ids for o in tiny.generate(PROMPTS, params)] == [o.token_ids for o in ample.generate(PROMPTS, params)]
    assert tiny.stats["preemptions"] > 0
    assert_no_leak(tiny)
    assert_no_leak(ample)
