"""Speculative decoding is lossless, for every proposer: greedy output equals plain greedy output
token for token, and sampled output has exactly the target's sequence distribution."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from chisquare import chi_square_pvalue
from conftest import PROMPTS, PROPOSERS, assert_no_leak, greedy, proposer_args, reference_probs
from nanospec import LLM, SamplingParams, proposer, sampler
from nanospec.dynamic_k import Profile, twin
from nanospec.k_policy import StaticK


@pytest.mark.slow
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


@pytest.mark.parametrize("name", ["eagle1", "eagle3", "hybrid_eagle3"])
def test_a_head_that_runs_no_round_holds_back_few_features(spec_models, plain_greedy, monkeypatch, name):
    """K = 0 in every step (the queue-size switch-off at 0): no round feeds the head the target's
    features; observe feeds them without drafting once ABSORB_AT are held back, keeping the last
    for a later round's first step, so that what a request holds stays bounded. Then the switch-off
    lifted: the head drafts from where it was fed, and greedy output is plain greedy's either way."""
    monkeypatch.setattr(proposer, "ABSORB_AT", 6)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              speculative_disable_queue_size=0, **proposer_args(spec_models, name))
    eagle = getattr(llm.engine.proposer, "model", llm.engine.proposer)
    held, observe = [], type(eagle).observe
    monkeypatch.setattr(type(eagle), "observe", lambda self, request, features: (
        observe(self, request, features), held.append(self.catch_up_len(request, self.state(request))))[0])
    # each row's elements a catch-up feeds: a round's d_1 reads the last
    fed, catch_up = [], type(eagle).catch_up
    monkeypatch.setattr(type(eagle), "catch_up", lambda self, *args: (out := catch_up(self, *args),
                                                                      fed.extend(out[1]))[0])
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [plain_greedy[p] for p in PROMPTS]
    assert llm.stats["drafted_tokens"] == 0 and 0 < max(held) < 6
    llm.engine.k_policy.max_queue = len(PROMPTS)   # the switch-off lifted
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [plain_greedy[p] for p in PROMPTS]
    assert llm.stats["drafted_tokens"] > 0 and min(fed) >= 1
    assert_no_leak(llm)


def test_a_head_fed_without_a_round_that_writes_nan_drafts_nothing_more(spec_models, plain_greedy,
                                                                        monkeypatch):
    """No logits tell whether absorb's K/V are finite: it reads them. A head that writes NaN there
    (its weights poisoned after loading) has them zeroed (no slot another request may read holds
    them) and publishes nothing, and that request's head drafts nothing more: plain greedy output."""
    monkeypatch.setattr(proposer, "ABSORB_AT", 6)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, block_size=4,
              speculative_disable_queue_size=0, **proposer_args(spec_models, "eagle1"))
    eagle = llm.engine.proposer
    with torch.no_grad():
        eagle.head.fc.weight.fill_(float("nan"))
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [plain_greedy[p] for p in PROMPTS]
    assert bool(torch.isfinite(eagle.kv_cache.pool).all()) and not eagle.kv_cache.allocator.published
    assert_no_leak(llm)


@pytest.mark.parametrize("tree", [{}, dict(speculative_topk=2, speculative_num_steps=3)])
def test_an_eagle_head_with_a_token_map_decodes_as_plain_greedy(spec_models, plain_greedy, tree):
    """Drafting among a token map's ids (half the vocabulary, and the prompts' ids) changes the
    drafts, never the output: chains and EAGLE-2 trees."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              num_speculative_tokens=4, **proposer_args(spec_models, "eagle1_map"), **tree)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outs] == [plain_greedy[p] for p in PROMPTS]
    assert llm.stats["drafted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.slow
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
    if name.startswith("hybrid"):   # its choice of drafts follows the run's history, so sampled tokens
        return                      # (not their distribution) do: see test_exact_sampling_end_to_end
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=i,
                             ignore_eos=True) for i in range(8)]
    assert [o.token_ids for o in tiny.generate(PROMPTS,
                                               params)] == [o.token_ids for o in ample.generate(PROMPTS,
                                                                                                params)]
    assert tiny.stats["preemptions"] > 0
    assert_no_leak(tiny)
    assert_no_leak(ample)


@pytest.mark.parametrize("name", PROPOSERS)
def test_twin_engines_decode_side_by_side(spec_models, plain_greedy, name):
    """dynamic_k.twin (the benchmark's rows): two engines over one model and proposer, at K = 3 and
    K = 1, stepped in turn, each decode as plain greedy decoding does, in caches of their own (a
    draft's or EAGLE head's pool has as many blocks as the target's, so it cannot be shared)."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              num_speculative_tokens=3, **proposer_args(spec_models, name))
    twins = [twin(llm.engine, k_policy=StaticK(3)), twin(llm.engine, k_policy=StaticK(1))]
    requests = [[e.new_request(i, p, llm.encode_prompt(p), greedy()) for i, p in enumerate(PROMPTS)]
                for e in twins]
    for engine, reqs in zip(twins, requests):
        engine.add_requests(reqs)
    while any(e.scheduler.has_work() for e in twins):
        for engine in [e for e in twins if e.scheduler.has_work()]:
            engine.step()
    for engine, reqs in zip(twins, requests):
        assert [r.output_ids for r in reqs] == [plain_greedy[p] for p in PROMPTS]
        assert engine.model is llm.model and engine.kv_cache is not llm.engine.kv_cache
        if hasattr(llm.engine.proposer, "kv_cache"):   # sized like the target's pool, so one each
            assert engine.proposer.kv_cache is not llm.engine.proposer.kv_cache
        assert engine.stats.drafted_tokens > 0
        assert_no_leak(SimpleNamespace(engine=engine))
    assert_no_leak(llm)
    assert llm.engine.stats.steps == 0


# End to end, sampled: a target with an 8-token vocabulary, so that every sequence of 3 generated
# tokens (512 of them) has an exact probability, computed by transformers in float64.
VOCAB, PROMPT, SAMPLES = 8, [1, 5, 2, 1, 5, 2, 1], 4000
SAMPLING = {"plain": dict(temperature=1.0), "truncated": dict(temperature=0.8, top_k=6, top_p=0.9)}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from conftest import write_checkpoint, write_eagle_head
    root = tmp_path_factory.mktemp("small_vocab")
    target = write_checkpoint(str(root / "target"), "llama3", seed=7, num_layers=4, model_vocab=VOCAB)
    # For dynamic K: K = 3 while the profile's optimistic rates hold (warm-up) and for small batches,
    # then mostly K = 1 at batch 512 once the online rates show these random proposers' 0.2-0.5.
    profile = Profile([1, 512], [0, 1, 3], [[1.0, 1.0, 1.0], [1.0, 1.2, 1.5]], [0.9, 0.8, 0.7])
    profile.save(str(root / "profile.json"))
    torch.save([1, 2, 5, 6], str(root / "token_map.pt"))
    return {"target": target, "profile": str(root / "profile.json"), "token_map": str(root / "token_map.pt"),
            "draft": write_checkpoint(str(root / "draft"), "llama3", seed=8, num_layers=1, model_vocab=VOCAB),
            "eagle1": write_eagle_head(str(root / "eagle1"), target, 1, seed=9),
            "eagle3": write_eagle_head(str(root / "eagle3"), target, 3, seed=10, draft_vocab=6)}


def exact_sequence_probs(target: str, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """P(x1, x2, x3 | PROMPT) [V, V, V] = p(x1) p(x2 | x1) p(x3 | x1, x2), each p after temperature,
    top-k and top-p (the float64 definition in test_sampler), from transformers' float64 logits."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64)
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    ids = torch.tensor([PROMPT + [a, b] for a, b in pairs])
    with torch.no_grad():
        logits = model(ids).logits[:, -3:].numpy()                         # [V*V, 3, V]
    dist = lambda row: reference_probs(row, temperature, top_k, top_p)
    probs = np.zeros((VOCAB,) * 3)
    for n, (a, b) in enumerate(pairs):
        probs[a, b, :] = dist(logits[0, 0])[a] * dist(logits[n, 1])[b] * dist(logits[n, 2])
    return probs


def sampled_sequence_counts(llm, sampling: dict) -> np.ndarray:
    params = [SamplingParams(max_tokens=6, seed=s, ignore_eos=True, **sampling) for s in range(SAMPLES)]
    counts = np.zeros((VOCAB,) * 3)
    for out in llm.generate([PROMPT] * SAMPLES, params):
        counts[tuple(out.token_ids[:3])] += 1
    return counts


def small_vocab_llm(small_vocab, name: str, k: int | str):
    args = {"ngram": dict(ngram=True), "draft": dict(draft=small_vocab["draft"]),
            "eagle1": dict(eagle=small_vocab["eagle1"]), "eagle3": dict(eagle=small_vocab["eagle3"]),
            "eagle1_map": dict(eagle=small_vocab["eagle1"], speculative_token_map=small_vocab["token_map"]),
            "suffix": dict(suffix=True), "hybrid_draft": dict(suffix=True, draft=small_vocab["draft"]),
            "hybrid_eagle3": dict(suffix=True, eagle=small_vocab["eagle3"])}[name]
    if isinstance(k, int):
        k_args = dict(num_speculative_tokens=k)
    elif name.startswith("hybrid"):
        k_args = dict(dynamic_k=True)
    else:
        k_args = dict(dynamic_k=True, profile=small_vocab["profile"],
                      per_request_k=k == "dynamic-per-request")
    return LLM(small_vocab["target"], device="cpu", dtype="float32", kv_cache_gb=0.2, max_num_seqs=512,
               max_num_batched_tokens=4096, **k_args, **args)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("k", [1, 3, "dynamic", "dynamic-per-request"])
@pytest.mark.parametrize("name", ["ngram", "draft", "eagle1", "eagle3"])
def test_output_has_the_target_sequence_distribution(small_vocab, name, k, sampling):
    """Chi-square over all 512 sequences of 3 tokens (level 1e-4: with 32 such tests, a false alarm
    has odds of about 1 in 300; test_a_broken_sampler_is_detected_end_to_end shows the power)."""
    check_distribution(small_vocab, name, k, sampling)


def check_distribution(small_vocab, name: str, k, sampling: str):
    llm = small_vocab_llm(small_vocab, name, k)
    counts = sampled_sequence_counts(llm, SAMPLING[sampling])
    assert llm.stats["accepted_tokens"] > 0 and llm.stats["drafted_tokens"] > llm.stats["accepted_tokens"]
    if not isinstance(k, int) and name.startswith("hybrid"):   # its priced plans did change during the run
        assert sum(steps > 0 for steps in llm.engine.proposer.plans.chosen.values()) >= 2
    elif not isinstance(k, int):   # the policy did change K during the run
        assert len({k for per_batch in llm.stats["chosen_k"].values() for k in per_batch}) >= 2
    assert chi_square_pvalue(counts, exact_sequence_probs(small_vocab["target"], **SAMPLING[sampling])) > 1e-4
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_a_token_map_keeps_the_target_sequence_distribution(small_vocab, sampling):
    """The same chi-square for an EAGLE-1 head that drafts among 4 of the 8 ids: its q is zero at the
    others, which the target still samples (the residual max(p - q, 0) carries their mass)."""
    llm = check_distribution(small_vocab, "eagle1_map", 3, sampling)
    assert llm.draft_models.head.hot_ids.tolist() == [1, 2, 5, 6]


@pytest.mark.slow
def test_a_broken_sampler_is_detected_end_to_end(small_vocab, monkeypatch):
    """Drawing the recovered token from p instead of max(p - q, 0) fails the same test."""
    monkeypatch.setattr(sampler, "next_token_weights", lambda p_next, q_next, rejected: p_next)
    counts = sampled_sequence_counts(small_vocab_llm(small_vocab, "draft", 1), SAMPLING["plain"])
    assert chi_square_pvalue(counts, exact_sequence_probs(small_vocab["target"])) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("name,k", [("suffix", 3), ("suffix", "dynamic"), ("hybrid_draft", 3),
                                    ("hybrid_eagle3", "dynamic")])
def test_suffix_and_hybrid_output_has_the_target_sequence_distribution(small_vocab, name, k, sampling):
    """The same chi-square, the 4,000 requests one prompt: suffix decoding's global index drafts
    each request from the earlier ones' outputs, and the hybrid mixes those one-hot drafts with
    the model's in one step (both kinds are used here)."""
    llm = check_distribution(small_vocab, name, k, sampling)
    if name.startswith("hybrid"):
        proposer = llm.engine.proposer
        assert sum(n for _, n in proposer.bins) > 0 and sum(proposer.model_drafted) > 0
