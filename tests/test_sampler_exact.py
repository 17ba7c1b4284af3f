"""Sampling is exact at a real vocabulary size (Qwen's 151,936 ids), over 10^7 batched draws: a
token of probability 0 is never drawn, top-k = 1 is the argmax, a tail of tokens of probability
1e-8 each is drawn at its mass, and the noise behind the draws is strictly inside (0, 1), fine
enough for such tails, and never shared by two draws. Faults of each kind are injected in
test_sampler_power.py, to show these tests fail on them."""
import math

import pytest
import torch

from nanospec import sampler
from nanospec.sampler import EMIT, pick, target_probs, uniform_noise

VOCAB = 151_936
KINDS = ["tail", "top_k_4", "top_p_0.5", "top_k_1", "greedy"]
ROWS_PER_KIND, DRAWS_PER_ROW = 8, 250_000          # 5 kinds x 8 rows x 250,000 = 10^7 draws
HEAD, TAIL, TAIL_P = 16, 100_000, 1e-8


def tail_row(g: torch.Generator) -> torch.Tensor:
    """Logits of 16 likely tokens (mass 1 - 1e-3), 100,000 tokens of probability 1e-8 and the rest
    impossible (-inf), scattered over the vocabulary so that zeros sit between positive tokens."""
    ids = torch.randperm(VOCAB, generator=g)
    head = torch.softmax(torch.randn(HEAD, generator=g, dtype=torch.float64), 0) * (1 - TAIL * TAIL_P)
    logits = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
    logits[ids[:HEAD]] = head.log()
    logits[ids[HEAD:HEAD + TAIL]] = math.log(TAIL_P)
    return logits


def batch():
    """40 rows of the five kinds (logits [40, V] float64) and their sampling parameters."""
    g = torch.Generator().manual_seed(0)
    logits, params = [], []
    for kind in KINDS:
        for _ in range(ROWS_PER_KIND):
            logits.append(tail_row(g) if kind == "tail"
                          else torch.randn(VOCAB, generator=g, dtype=torch.float64) * 3)
            params.append({"tail": (1.0, 0, 1.0), "top_k_4": (1.0, 4, 1.0), "top_p_0.5": (1.0, 0, 0.5),
                           "top_k_1": (1.0, 1, 1.0), "greedy": (0.0, 0, 1.0)}[kind])
    t, k, p = zip(*params)
    return torch.stack(logits), torch.tensor(t), torch.tensor(k), torch.tensor(p)


@pytest.fixture(scope="module")
def draws():
    """10^7 draws: each row's distribution once (the sampler's target_probs), each draw with the
    noise of its own (seed, position)."""
    logits, t, k, p = batch()
    probs = target_probs(logits.float(), t, k, p)
    rows = len(logits)
    seeds = torch.arange(rows * DRAWS_PER_ROW) * 7919 + 13
    u = uniform_noise(seeds, seeds % 4093, EMIT).view(rows, DRAWS_PER_ROW)
    return logits, probs, pick(probs, u)


@pytest.mark.slow
def test_a_token_of_probability_zero_is_never_drawn(draws):
    logits, probs, tokens = draws
    assert tokens.numel() >= 10**7
    assert (probs.gather(1, tokens) > 0).all()
    # the zeros are where the definition puts them: -inf logits, beyond top-k, beyond top-p
    assert ((probs > 0).sum(1)[8:16] == 4).all() and ((probs > 0).sum(1)[24:40] == 1).all()
    assert ((probs > 0).sum(1)[:8] == HEAD + TAIL).all()


def test_top_k_1_and_greedy_are_the_argmax(draws):
    logits, probs, tokens = draws
    rows = slice(3 * ROWS_PER_KIND, 5 * ROWS_PER_KIND)
    assert (tokens[rows] == logits[rows].argmax(1, keepdim=True)).all()


def test_a_tail_of_1e_8_tokens_is_drawn_at_its_mass(draws):
    """8 rows x 250,000 draws of a tail of mass 1e-3: binomial, mean 2000, sd 44.7; 5 sd allowed."""
    logits, probs, tokens = draws
    rows = slice(0, ROWS_PER_KIND)
    in_tail = (logits[rows].gather(1, tokens[rows]) < -15).sum().item()   # log(1e-8) = -18.4
    n, mass = ROWS_PER_KIND * DRAWS_PER_ROW, TAIL * TAIL_P
    assert abs(in_tail - n * mass) < 5 * math.sqrt(n * mass * (1 - mass))
    # and spread over the tail, not a few tokens of it: about 2000 draws over 100,000 tokens
    distinct = torch.unique(tokens[rows][logits[rows].gather(1, tokens[rows]) < -15]).numel()
    assert distinct > 0.95 * in_tail


def test_noise_is_strictly_inside_the_unit_interval():
    """At the extreme bit patterns (where rounding could reach 0 or 1) and over 10^6 draws."""
    top = 2**sampler.NOISE_BITS
    extremes = sampler.unit_interval(torch.tensor([0, 1, top - 2, top - 1]))
    assert (extremes > 0).all() and (extremes < 1).all()
    u = uniform_noise(torch.arange(10**6), torch.arange(10**6) % 977, EMIT)
    assert 0 < u.min() and u.max() < 1


def test_noise_has_52_bits():
    """Every one of the 52 bits is used and fair (a 24-bit noise cannot draw a 1e-8 token at its
    probability): the fraction of ones per bit is 1/2 within 5 sd over 10^6 draws."""
    u = uniform_noise(torch.arange(10**6), torch.zeros(10**6, dtype=torch.long), EMIT)
    bits = (u * 2.0**sampler.NOISE_BITS - 0.5).long()
    ones = torch.stack([(bits >> b) & 1 for b in range(sampler.NOISE_BITS)]).double().mean(1)
    assert ((ones - 0.5).abs() < 5 * 0.5 / 1000).all()


@pytest.mark.slow
def test_distinct_draws_have_distinct_noise():
    """1000 seeds x 1000 positions x 3 streams: 3 * 10^6 uniforms, no two equal (52 bits: a
    coincidence has probability 2e-4) and neighbouring seeds and positions uncorrelated."""
    seeds = torch.arange(1000).repeat_interleave(1000)
    positions = torch.arange(1000).repeat(1000)
    u = torch.stack([uniform_noise(seeds, positions, s) for s in range(3)])   # [3, 10^6]
    assert torch.unique(u).numel() == u.numel()
    grid = u.view(3, 1000, 1000) - 0.5
    for a, b in [(grid[:, 1:], grid[:, :-1]), (grid[:, :, 1:], grid[:, :, :-1]), (grid[0], grid[1])]:
        assert abs((a * b).mean().item() * 12) < 0.01    # correlation; sd about 0.001


def test_pick_never_picks_a_zero_weight_whatever_the_noise():
    """Zeros at both ends and inside; u at 0, 1 and next to them (u is never 0 or 1, but pick does
    not rely on it); weights that do not sum to 1; a single positive weight."""
    w = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 1e-30, 0.0, 0.0],
                      [0.0, 2.0, 5.0, 0.0, 1e-12, 0.0]], dtype=torch.float32)
    for u in [0.0, 2.0**-53, 0.3, 0.5, 1 - 2.0**-53, 1.0]:
        idx = pick(w, torch.full((3,), u, dtype=torch.float64))
        assert (w.gather(1, idx[:, None]) > 0).all(), u


def test_top_p_one_keeps_every_token_top_k_keeps():
    """top_p = 1 is off even where the mass before a tail token rounds to 1 (p about 1e-22 here),
    with top-k on and beside a row that truncates."""
    logits = torch.full((2, VOCAB), -60.0)
    logits[:, :2] = torch.tensor([1.0, 0.5])
    probs = target_probs(logits, torch.ones(2), torch.tensor([50, 0]), torch.tensor([1.0, 0.9]))
    assert (probs[0] > 0).sum() == 50
    alone = target_probs(logits[:1], torch.ones(1), torch.tensor([50]), torch.ones(1))
    assert torch.equal(probs[:1], alone)


def test_a_row_does_not_depend_on_its_batch():
    """A row's distribution is bit for bit the same alone (no truncation pass at all) and beside
    greedy, top-k, top-p and other temperatures, at the real vocabulary size."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, VOCAB, generator=g) * 4
    t, k = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0]), torch.tensor([0, 0, 5, 0, 0])
    p = torch.tensor([1.0, 1, 1, 0.8, 1])
    batched = target_probs(logits, t, k, p, truncate=True)
    for i in (0, 4):
        alone = target_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], truncate=False)[0]
        assert torch.equal(batched[i], alone)
    for i in range(5):
        assert torch.equal(batched[i], target_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1])[0])


# ---- these tests have the power to fail: each fault below, injected into the sampler, fails one ----

real_noise = sampler.uniform_noise


def noise_reaching_one(bits):
    """The old 24-bit float32 noise: (2^24 - 1/2) / 2^24 rounds to 1.0."""
    return ((bits >> (sampler.NOISE_BITS - 24)).float() + 0.5) * (1.0 / (1 << 24))


def coarse_noise(bits):
    """24 bits of noise, kept inside (0, 1): too coarse to draw a 1e-8 token at its probability."""
    return ((bits >> (sampler.NOISE_BITS - 24)).double() + 0.5) * 2.0 ** -24


def counters_xored(seeds, positions, stream, key):
    """Counters xored together, then hashed: (seed 1, position 2) and (seed 2, position 1) share
    their noise (as noise columns xored into the row hash did)."""
    return sampler._mix32(sampler._mix32((seeds ^ positions ^ stream) & sampler.MASK32) ^ key)


def top_p_on_every_row(mass_before, top_p):
    """top-p applied to rows with top_p = 1, where the mass before a tail token rounds to 1."""
    return mass_before < top_p[:, None]


FAULTS = {
    "noise reaches 1.0": ("unit_interval", noise_reaching_one,
                          test_noise_is_strictly_inside_the_unit_interval),
    "24-bit noise": ("unit_interval", coarse_noise, test_noise_has_52_bits),
    "top-p applied to top_p = 1 rows": ("top_p_keeps", top_p_on_every_row,
                                        test_top_p_one_keeps_every_token_top_k_keeps),
    "counters xored into one hash": ("_counter_hash", counters_xored,
                                     test_distinct_draws_have_distinct_noise),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_these_tests_fail_on_a_broken_sampler(monkeypatch, fault):
    name, broken, test = FAULTS[fault]
    test()                                   # passes on the real sampler
    monkeypatch.setattr(sampler, name, broken)
    with pytest.raises(AssertionError):
        test()
