"""The sampler draws from exactly the distribution temperature / top-k / top-p define, per row,
reproducibly from (seed, position), whatever else shares the batch."""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import reference_probs
from nanospec import logits_processors, sampler
from nanospec.sampler import Sampler, sample, target_probs, uniform_noise

# 99.9% quantile of the chi-square distribution with 5 degrees of freedom.
CHI2_DF5_999 = 20.515


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(logits=st.lists(st.floats(-8, 8), min_size=2, max_size=12),
       temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
       top_k=st.integers(0, 12), top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
def test_target_probs_is_the_definition(logits, temperature, top_k, top_p):
    x = np.array(logits)
    assume(len(set(np.round(x, 4))) == len(x))   # ties make "the k most likely" ambiguous
    got = target_probs(torch.tensor([logits], dtype=torch.float64).float(), torch.tensor([temperature]),
                       torch.tensor([top_k]), torch.tensor([top_p]))[0].double().numpy()
    expected = reference_probs(x.astype(np.float32).astype(np.float64), temperature, top_k, top_p)
    assert np.abs(got - expected).max() < 1e-5


def test_rows_use_their_own_parameters():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    t, k, p = torch.tensor([0.0, 0.7, 1.3]), torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.8])
    batched = target_probs(logits, t, k, p)
    for i in range(3):
        alone = target_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1])[0]
        assert torch.allclose(batched[i], alone)


def test_samples_follow_the_distribution():
    """20000 draws with different seeds: a chi-square test against the target probabilities."""
    n, probs = 20000, torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    logits = probs.log().expand(n, -1)
    tokens = sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                    seeds=torch.arange(n) * 7919 + 11, positions=torch.full((n,), 5))
    counts = torch.bincount(tokens, minlength=6).double()
    chi2 = ((counts - n * probs.double()) ** 2 / (n * probs.double())).sum().item()
    assert chi2 < CHI2_DF5_999


def test_a_broken_sampler_is_detected():
    """The same test rejects a sampler that ignores temperature (so the test above can fail)."""
    n, probs = 20000, torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28])
    logits = probs.log().expand(n, -1)
    tokens = sample(logits * 1.3, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n),
                    seeds=torch.arange(n) * 7919 + 11, positions=torch.full((n,), 5))
    counts = torch.bincount(tokens, minlength=6).double()
    assert ((counts - n * probs.double()) ** 2 / (n * probs.double())).sum().item() > CHI2_DF5_999


def test_draws_depend_only_on_seed_and_position():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    args = (torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4))
    seeds, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([10, 10, 11, 12])
    batch = sample(logits, *args, seeds, pos)
    alone = torch.stack([sample(logits[i:i + 1], *(a[i:i + 1] for a in args), seeds[i:i + 1], pos[i:i + 1])[0]
                         for i in range(4)])
    assert torch.equal(batch, alone)
    assert torch.equal(batch, sample(logits, *args, seeds, pos))


def test_uniform_noise_is_uniform():
    u = uniform_noise(torch.arange(64).repeat_interleave(4096), torch.arange(4096).repeat(64), stream=0)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.001
    counts = torch.histc(u, bins=16, min=0, max=1).double()
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 37.7   # chi-square 99.9%, 15 df


@pytest.mark.slow
def test_compiled_sampler_equals_eager():
    compiled = torch.compile(sample, dynamic=True)
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    args = (torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0]), torch.tensor([0, 0, 10, 0, 3]),
            torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0]), torch.arange(5) + 100, torch.arange(5) * 3)
    assert torch.equal(compiled(logits, *args), sample(logits, *args))


@settings(max_examples=200, deadline=None)
@given(logits=st.lists(st.integers(-3, 3), min_size=2, max_size=40),
       top_k=st.lists(st.integers(0, 45), min_size=3, max_size=3))
def test_top_k_without_a_sort_is_top_k_with_one(logits, top_k):
    """The threshold path (a batch with top-k and no top-p) keeps exactly the tokens the sorted
    path keeps, ties at the k-th logit included (integer logits: ties everywhere)."""
    x = torch.tensor([logits] * 3, dtype=torch.float32)
    k, p, t = torch.tensor(top_k), torch.ones(3), torch.tensor([1.0, 0.5, 2.0])
    limits = sampler.Truncation(max(top_k), top_p=False)
    if 0 < limits.top_k <= len(logits) // 2:   # where target_probs takes the threshold path
        assert torch.equal(target_probs(x, t, k, p, limits), target_probs(x, t, k, p, True))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(logits=st.lists(st.one_of(st.integers(-3, 3), st.just(-1000)), min_size=2, max_size=40),
       top_k=st.lists(st.integers(0, 45), min_size=3, max_size=3),
       top_p=st.lists(st.one_of(st.just(1.0), st.floats(0.05, 1.0)), min_size=3, max_size=3))
def test_top_p_within_top_k_sorts_only_the_candidates_and_keeps_what_the_full_sort_keeps(logits, top_k,
                                                                                          top_p):
    """Where every row that uses top-p has a top_k, top-p ranks only each row's largest top_k
    candidates (no sort over the vocabulary): the same probabilities, bit for bit, as the full sort,
    ties everywhere (integer logits) and -inf among them (min_p's masked tokens); a row with neither
    keeps its softmax."""
    x = torch.tensor([logits] * 3, dtype=torch.float32).masked_fill(torch.tensor([logits] * 3) == -1000,
                                                                    float("-inf"))
    assume(x.isfinite().any())
    top_p = [p if k else 1.0 for p, k in zip(top_p, top_k)]   # a top-p row has a top_k
    k, p, t = torch.tensor(top_k), torch.tensor(top_p), torch.tensor([1.0, 0.5, 2.0])
    limits = sampler.Truncation(max(top_k), top_p=True, top_p_within_top_k=True)
    if 0 < limits.top_k <= len(logits) // 2:   # where truncate_top_k_top_p takes the candidates
        assert torch.equal(target_probs(x, t, k, p, limits), target_probs(x, t, k, p, True))


@pytest.mark.parametrize("seed", range(6))
def test_top_p_without_top_k_ranks_a_few_candidates_and_keeps_what_the_full_sort_keeps(seed, monkeypatch):
    """A top-p row without top-k (Llama's defaults) on a CPU ranks its FEW_CANDIDATES largest, and
    more while they hold less than top_p: the same probabilities, bit for bit, as ranking the whole
    vocabulary, for peaked and flat rows (a flat row ranks them all), beside top-k rows and rows
    that truncate nothing. A check that stopped at the first candidates fails it."""
    g = torch.Generator().manual_seed(seed)
    vocab = 4096
    scale = torch.tensor([8.0, 3.0, 0.05, 1.0, 6.0, 0.0])[:, None]   # peaked .. flat, one row all ties
    logits = torch.randn(6, vocab, generator=g) * scale
    logits[5, :7] = 1.0
    top_k = torch.tensor([0, 0, 0, 40, 0, 0])
    top_p = torch.tensor([0.9, 0.95, 0.9, 0.8, 1.0, 0.5])
    t = torch.tensor([0.6, 1.0, 1.0, 0.7, 1.0, 1.0])
    ranked_sizes = []
    real_ranked = sampler.ranked
    monkeypatch.setattr(sampler, "ranked", lambda x, k=None: (ranked_sizes.append(k), real_ranked(x, k))[1])
    got = target_probs(logits, t, top_k, top_p, sampler.Truncation(40, True, False))
    # grew, then sorted all (the flat row)
    assert ranked_sizes[0] == sampler.FEW_CANDIDATES and None in ranked_sizes
    assert torch.equal(got, target_probs(logits, t, top_k, top_p, True))
    ranked_sizes.clear()
    peaked = target_probs(logits[:1], t[:1], top_k[:1], top_p[:1], sampler.Truncation(0, True, False))
    assert ranked_sizes == [sampler.FEW_CANDIDATES] and torch.equal(peaked, got[:1])   # the few: its top-p
    ranked_sizes.clear()   # a greedy row's top_p (a checkpoint's default) grows nothing: it is unused
    beside_greedy = target_probs(logits[[0, 2]], torch.tensor([0.6, 0.0]), top_k[[0, 2]], top_p[[0, 2]],
                                 sampler.Truncation(0, True, False))
    assert ranked_sizes == [sampler.FEW_CANDIDATES] and torch.equal(beside_greedy[0], got[0])


def test_the_candidates_are_the_first_ranks_of_the_stable_sort():
    """sampler.ranked with largest_k: the first largest_k ids of the full stable descending sort,
    at a real vocabulary with ties at the k-th logit."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-20, 20, (6, 151936), generator=g).float()
    for k in (1, 20, 64):
        assert torch.equal(sampler.ranked(logits, k), sampler.ranked(logits)[:, :k])


def run_verify_shapes(sampler, buckets, ks, vocab=50, sampled_ks=()):
    """Call the sampler as the decode step does, for each bucket and K (greedy), and for each bucket
    and K in sampled_ks (sampling, with and without draft probabilities, truncating)."""
    g = torch.Generator().manual_seed(0)
    for bucket in buckets:
        num_draft = torch.randint(0, 9, (bucket,), generator=g)
        for k in ks:
            nd = num_draft.clamp(max=k)
            sampler.verify_greedy(torch.randint(0, vocab, (bucket, k + 1), generator=g),
                                  torch.randint(0, vocab, (bucket, k), generator=g), nd)
        for k in sampled_ks:
            nd = num_draft.clamp(max=k)
            for probs in (None, torch.softmax(torch.randn(bucket, k, vocab, generator=g), -1)):
                sampler.rejection_sample(torch.randn(bucket, k + 1, vocab, generator=g),
                                         torch.randint(0, vocab, (bucket, k), generator=g), probs, nd,
                                         torch.full((bucket,), 0.8), torch.zeros(bucket, dtype=torch.long),
                                         torch.full((bucket,), 0.9), torch.arange(bucket),
                                         torch.arange(bucket) + 7, True)


@pytest.mark.slow
def test_the_compiled_sampler_meets_every_bucket_and_k_within_its_recompile_limit():
    """Compiled (dynamo with its eager backend: the same guards and recompiles as inductor, in
    seconds), the sampler meets the decode step's shapes, every bucket up to 40 for K 0..8: greedy
    verification is never compiled, a sampled batch of 1 runs eagerly, and the sampled batches
    compile exactly one variant per K and kind (with and without draft probabilities; the batch is
    dynamic). Pinned: a change that compiles more (per bucket, per grad mode) fails here."""
    from nanospec.cuda_graph import batch_buckets
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    sampler = Sampler(compile=True, max_k=8, backend="eager")
    run_verify_shapes(sampler, batch_buckets(40), range(9))
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    with torch.inference_mode():   # as every step runs
        run_verify_shapes(sampler, batch_buckets(40), [], sampled_ks=(0, 1, 8))
    assert counters["stats"]["unique_graphs"] == 3 * 2, dict(counters["stats"])


@pytest.mark.slow
def test_a_compiled_sampler_past_its_recompile_limit_raises_instead_of_running_eagerly():
    """Room for K 0..1 only (8 variants), sampled K 0..8 met: dynamo's limit is reached and it
    raises, where its default is to fall back to eager without a word."""
    from nanospec.cuda_graph import batch_buckets
    torch._dynamo.reset()
    sampler = Sampler(compile=True, max_k=1, backend="eager")
    with pytest.raises(Exception, match="recompile|cache_size|limit"):
        run_verify_shapes(sampler, batch_buckets(40), [], sampled_ks=range(9))
    torch._dynamo.reset()


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p = 1e-300 is > 0 (valid) but 0 in float32: top-p still keeps the most likely token, as
    vLLM does (it kept none, and sampling drew token 0)."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0]])
    probs = target_probs(logits, torch.tensor([1.0]), torch.tensor([0]),
                         torch.tensor([1e-300], dtype=torch.float32))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def penalties_oracle(logits, prompt, output, drafts, rep, freq, pres):
    """vLLM's penalties in float64, position by position: position j follows the output and
    d_1 .. d_j."""
    out = torch.empty_like(logits, dtype=torch.float64)
    for j in range(logits.shape[0]):
        counts = torch.bincount(torch.tensor(output + drafts[:j], dtype=torch.long),
                                minlength=logits.shape[1]).double()
        seen = counts > 0
        hit = seen.clone()
        hit[prompt] = True
        x = logits[j].double()
        out[j] = (torch.where(hit, torch.where(x > 0, x / rep, x * rep), x) - freq * counts
                  - pres * seen.double())
    return out


@pytest.mark.parametrize("break_it", [False, True])
def test_penalties_in_one_batch_are_each_rows_at_each_position(break_it):
    """logits_processors.penalize over three requests at once, Qwen's vocabulary, K = 4 with tokens drafted
    twice and drafts that are in the output or the prompt: each row, at each position, is the float64
    definition applied to that row alone (within float32 rounding). Leaving the drafts out (every
    position penalized as the first) fails every row."""
    vocab, g = 151936, torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, vocab, generator=g) * 4
    prompts, outputs = [[7, 8, 9], [10], [3, 3]], [[1, 2, 2, 5], [], [4, 4, 4, 6]]
    drafts = [[2, 2, 7, 1], [11, 12, 11, 11], [4, 3, 9, 4]]
    rep, freq, pres = [1.3, 0.8, 1.0], [0.4, -0.5, 0.0], [0.3, 0.0, -1.2]
    counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=vocab).float()
                          for o in outputs])
    masks = torch.stack([logits_processors.prompt_mask(p, vocab, torch.device("cpu")) for p in prompts])
    seen_drafts = torch.tensor(drafts)[:, :0] if break_it else torch.tensor(drafts)
    got = logits_processors.penalize(logits, masks, counts, seen_drafts, torch.tensor(rep),
                                     torch.tensor(freq), torch.tensor(pres))
    wrong = 0
    for r in range(3):
        want = penalties_oracle(logits[r], prompts[r], outputs[r], drafts[r], rep[r], freq[r], pres[r])
        wrong += not torch.allclose(got[r].double(), want, atol=1e-5, rtol=0)
    assert wrong == (3 if break_it else 0)


def test_min_p_in_one_batch_is_each_rows():
    """logits_processors.min_p_mask over rows of their own temperature and min_p: a token stays where its
    probability at the row's temperature is at least min_p x the most likely's (float64), and
    min_p 0 keeps every token."""
    logits = torch.randn(3, 2, 1000, generator=torch.Generator().manual_seed(1)) * 3
    temperature, min_p = torch.tensor([0.7, 1.5, 1.0]), torch.tensor([0.1, 0.3, 0.0])
    got = logits_processors.min_p_mask(logits, temperature, min_p)
    for r in range(3):
        probs = torch.softmax(logits[r].double() / temperature[r].item(), dim=-1)
        keep = probs >= min_p[r].item() * probs.max(-1, keepdim=True).values
        assert torch.equal(got[r].isfinite(), keep) and torch.equal(got[r][keep], logits[r][keep])
    assert got[2].isfinite().all() and not got[:2].isfinite().all()
