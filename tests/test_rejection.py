"""The rejection sampler is lossless: whatever the draft proposes, the emitted tokens follow the
target's distribution p exactly, and the number of accepted drafts follows its closed form."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chisquare import chi_square_pvalue
from nanospec import sampler
from nanospec.sampler import (acceptance_probability, next_token_weights, pick, rejection_sample,
                              target_probs, uniform_noise, verify_greedy)

logit = st.one_of(st.floats(-6, 6), st.just(float("-inf")))   # -inf: a token with probability 0


@st.composite
def target_and_draft(draw, vocab=None):
    """(p, q) over a small vocabulary after one temperature / top-k / top-p, as the engine builds
    them: zeros in either, one-hot q (n-gram, greedy drafts) and q == p included."""
    v = vocab or draw(st.integers(2, 6))
    logits_p = draw(st.lists(st.floats(-6, 6), min_size=1, max_size=1).flatmap(
        lambda first: st.lists(logit, min_size=v - 1, max_size=v - 1).map(lambda rest: first + rest)))
    kind = draw(st.sampled_from(["model", "one_hot", "same"]))
    temperature = draw(st.one_of(st.just(0.0), st.floats(0.1, 3.0)))
    top_k = draw(st.integers(0, v))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
    as_probs = lambda logits: target_probs(torch.tensor([logits]), torch.tensor([temperature]),
                                           torch.tensor([top_k]), torch.tensor([top_p]))[0].double()
    as_probs = lambda logits, f=as_probs: f(logits) / f(logits).sum()   # exactly normalized in float64
    p = as_probs(logits_p)
    if kind == "same":
        return p, p.clone()
    if kind == "one_hot":
        q = torch.zeros(v, dtype=torch.float64)
        q[draw(st.integers(0, v - 1))] = 1.0
        return p, q
    logits_q = draw(st.lists(st.floats(-6, 6), min_size=1, max_size=1).flatmap(
        lambda first: st.lists(logit, min_size=v - 1, max_size=v - 1).map(lambda rest: first + rest)))
    return p, as_probs(logits_q)


def output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(emitted token = x) for one draft position, computed from the sampler's own pieces in
    float64: d ~ q is accepted with acceptance_probability, otherwise the token is raced over
    next_token_weights (a race picks x with probability weight(x) / sum of weights)."""
    drafts = torch.nonzero(q > 0).flatten()
    accept = acceptance_probability(p[drafts], q[drafts])                  # per possible draft
    out = torch.zeros_like(p)
    out[drafts] = q[drafts] * accept
    weights = next_token_weights(p[None], q[None], rejected=torch.tensor([True]))[0]
    return out + (q[drafts] * (1 - accept)).sum() * weights / weights.sum()


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(pq=target_and_draft())
def test_output_is_the_target_distribution_exactly(pq):
    p, q = pq
    assert torch.allclose(output_distribution(p, q), p, atol=1e-12, rtol=0)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(target_and_draft(vocab=4), min_size=1, max_size=4))
def test_accepted_count_has_its_closed_form(pairs):
    """P(N >= n) = prod_{j < n} alpha_j with alpha_j = sum_x min(p_j(x), q_j(x)) = 1 - TV(p_j, q_j)."""
    for p, q in pairs:
        drafts = torch.nonzero(q > 0).flatten()
        alpha = (q[drafts] * acceptance_probability(p[drafts], q[drafts])).sum()
        assert abs(alpha - torch.minimum(p, q).sum()) < 1e-12


# The batched sampler itself, sampled: 40000 rows share fixed per-position p_j and q_j. Each check
# is a chi-square test at level 1e-4 (a fixed sample: deterministic, and a true sampler fails one
# such check 1 time in 10^4); the broken-sampler test shows the same checks reject a real bug.
ROWS, VOCAB, K = 40000, 5, 3
P_LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.8, -1.0], [0.1, 0.9, 0.3, -0.4, 0.0],
                         [-0.3, 0.6, 1.2, 0.1, -0.8], [0.5, -0.2, 0.0, 0.7, 0.3]])
Q_LOGITS = torch.tensor([[0.2, 1.1, -0.2, -0.6, 0.4], [0.8, -0.5, 0.3, 0.6, -1.0],
                         [1.0, 0.0, -0.4, 0.2, 0.5]])


def run_batch(one_hot_drafts: bool, num_draft: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0):
    n = ROWS
    t, tk, tp = torch.full((n,), temperature), torch.full((n,), top_k), torch.full((n,), top_p)
    p = target_probs(P_LOGITS, t[:K + 1], tk[:K + 1], tp[:K + 1])
    seeds = torch.arange(n)
    if one_hot_drafts:   # n-gram-like drafts: a fixed guess per position
        draft_ids, draft_probs, q = torch.tensor([[0, 1, 2]]).expand(n, -1), None, None
    else:
        q = target_probs(Q_LOGITS, t[:K], tk[:K], tp[:K])
        noise = torch.stack([uniform_noise(seeds, torch.full((n,), j), sampler.DRAFT) for j in range(K)], 1)
        draft_ids = pick(q.expand(n, -1, -1).reshape(-1, VOCAB), noise.flatten()).view(n, K)
        draft_probs = q.expand(n, -1, -1)
    tokens, accepted = rejection_sample(P_LOGITS.expand(n, -1, -1), draft_ids, draft_probs, num_draft, t, tk,
                                        tp, seeds, positions=torch.zeros(n, dtype=torch.long))
    q = q if q is not None else torch.nn.functional.one_hot(torch.tensor([0, 1, 2]), VOCAB).float()
    return p.double(), q.double(), tokens, accepted


def accepted_count_probs(p, q, k):
    alpha = torch.minimum(p[:k], q[:k]).sum(-1)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])      # P(N >= n), n = 0..k
    return reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])     # P(N = n)


@pytest.mark.parametrize("one_hot_drafts", [False, True])
@pytest.mark.parametrize("truncation", [dict(), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_batched_sampler_emits_p_and_accepts_as_predicted(one_hot_drafts, truncation):
    num_draft = torch.full((ROWS,), K)
    p, q, tokens, accepted = run_batch(one_hot_drafts, num_draft, **truncation)
    assert chi_square_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), p[0]) > 1e-4
    reached = accepted >= 1   # given d_1 accepted, the next token is again either accepted or recovered: p_1
    assert chi_square_pvalue(torch.bincount(tokens[reached, 1], minlength=VOCAB), p[1]) > 1e-4
    assert chi_square_pvalue(torch.bincount(accepted, minlength=K + 1), accepted_count_probs(p, q, K)) > 1e-4


def test_rows_with_fewer_drafts_stop_there():
    num_draft = torch.arange(ROWS) % (K + 1)    # K = 0 .. 3 in one batch
    p, q, tokens, accepted = run_batch(False, num_draft)
    assert (accepted <= num_draft).all()
    for k in range(K + 1):
        rows = num_draft == k
        assert chi_square_pvalue(torch.bincount(accepted[rows], minlength=K + 1)[:k + 1],
                                 accepted_count_probs(p, q, k)) > 1e-4
        assert chi_square_pvalue(torch.bincount(tokens[rows, 0], minlength=VOCAB), p[0]) > 1e-4


def test_skipping_the_residual_is_detected(monkeypatch):
    """The same test rejects a sampler that draws the recovered token from p instead of
    max(p - q, 0): the tests above have the power to fail."""
    monkeypatch.setattr(sampler, "next_token_weights", lambda p_next, q_next, rejected: p_next)
    p, q, tokens, accepted = run_batch(False, torch.full((ROWS,), K))
    assert chi_square_pvalue(torch.bincount(tokens[:, 0], minlength=VOCAB), p[0]) < 1e-9


def test_greedy_accepts_while_draft_is_argmax():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]]] * 3)
    drafts = torch.tensor([[1, 0, 2], [1, 2, 2], [0, 0, 2]])
    tokens, accepted = verify_greedy(logits.argmax(-1), drafts, torch.tensor([3, 3, 3]))
    assert accepted.tolist() == [3, 1, 0]
    assert tokens.tolist() == [[1, 0, 2, 0]] * 3    # output: accepted drafts, then the argmax
    ones = torch.ones(3)
    sampled, sampled_accepted = rejection_sample(logits, drafts, None, torch.tensor([3, 3, 3]), ones * 0,
                                                 ones.long() * 0, ones, torch.arange(3),
                                                 torch.zeros(3, dtype=torch.long))
    assert sampled_accepted.tolist() == [3, 1, 0]
    assert all(sampled[b, :a + 1].tolist() == tokens[b, :a + 1].tolist() for b, a in enumerate([3, 1, 0]))


def test_without_drafts_it_is_plain_sampling():
    """K = 0: the emitted token uses the same noise as the plain sampler, so outputs coincide."""
    logits = torch.randn(6, 1, 40, generator=torch.Generator().manual_seed(3))
    t, tk = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.8]), torch.tensor([0, 0, 10, 0, 3, 0])
    tp = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0, 1.0])
    seeds, pos = torch.arange(6) + 5, torch.arange(6) * 2
    tokens, accepted = rejection_sample(logits, torch.zeros(6, 0, dtype=torch.long), None,
                                        torch.zeros(6, dtype=torch.long), t, tk, tp, seeds, pos)
    assert accepted.tolist() == [0] * 6
    assert torch.equal(tokens[:, 0], sampler.sample(logits[:, 0], t, tk, tp, seeds, pos))


@pytest.mark.slow
def test_compiled_rejection_sampler_equals_eager():
    compiled = torch.compile(rejection_sample, dynamic=True)
    p, q, _, _ = run_batch(False, torch.full((ROWS,), K))
    n = 64
    g = torch.Generator().manual_seed(4)
    logits, drafts = torch.randn(n, K + 1, VOCAB, generator=g), torch.randint(0, VOCAB, (n, K), generator=g)
    probs = torch.softmax(torch.randn(n, K, VOCAB, generator=g), -1)
    args = (logits, drafts, probs, torch.arange(n) % (K + 1), torch.full((n,), 0.9),
            torch.zeros(n, dtype=torch.long), torch.ones(n), torch.arange(n), torch.arange(n))
    for a, b in zip(compiled(*args), rejection_sample(*args)):
        assert torch.equal(a, b)


def test_one_hot_drafts_emit_what_plain_sampling_emits():
    """At a 32k vocabulary: drafts without probabilities (n-gram) are accepted exactly while they
    equal plain sampling's token at their position, and the tokens emitted are plain sampling's."""
    batch, k, vocab = 12, 4, 32_768
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    t = torch.tensor([1.0, 0.7, 0.0, 1.3] * 3)
    tk, tp = torch.tensor([0, 50, 0, 0] * 3), torch.tensor([1.0, 1.0, 1.0, 0.9] * 3)
    seeds, positions = torch.arange(batch) + 100, torch.arange(batch) * 5 + 3
    plain = torch.stack([sampler.sample(logits[:, i], t, tk, tp, seeds, positions + i)
                         for i in range(k + 1)], 1)
    right = torch.arange(batch) % (k + 1)                       # row b's first right - 1 drafts are right
    drafts = torch.where(torch.arange(k)[None, :] < right[:, None], plain[:, :k], (plain[:, :k] + 1) % vocab)
    tokens, accepted = rejection_sample(logits, drafts, None, torch.full((batch,), k), t, tk, tp, seeds,
                                        positions)
    assert accepted.tolist() == right.tolist()
    for b in range(batch):
        assert tokens[b, :right[b] + 1].tolist() == plain[b, :right[b] + 1].tolist()


# ---- this test has the power to fail: each fault below, injected into the sampler, fails it ----

real_noise = sampler.uniform_noise


def accept_uniform_reused(seeds, positions, stream):
    """The acceptance test's uniform the same at every position (and so in every step)."""
    return real_noise(seeds, positions * 0 if stream == sampler.ACCEPT else positions, stream)


def draft_noise_for_acceptance(seeds, positions, stream):
    """The acceptance test reuses the uniform that drew the draft."""
    return real_noise(seeds, positions, sampler.DRAFT if stream == sampler.ACCEPT else stream)


FAULTS = {
    "accept uniform reused across steps": ("uniform_noise", accept_uniform_reused),
    "residual skipped": ("next_token_weights", lambda p_next, q_next, rejected: p_next),
    "draft's noise reused for acceptance": ("uniform_noise", draft_noise_for_acceptance),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_rejection_test_fails_on_a_broken_sampler(monkeypatch, fault):
    name, broken = FAULTS[fault]
    test = lambda: test_batched_sampler_emits_p_and_accepts_as_predicted(False, {})
    test()                                   # passes on the real sampler
    monkeypatch.setattr(sampler, name, broken)
    with pytest.raises(AssertionError):
        test()
