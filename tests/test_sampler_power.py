"""The sampler tests have the power to fail: each fault below is injected into the sampler in turn,
and some test of the suite must then fail. A test that passes on a broken sampler proves nothing."""
import pytest
import torch

import test_rejection
import test_sampler_exact
from nanospec import sampler

real_noise = sampler.uniform_noise


def noise_reaching_one(bits):
    """The old 24-bit float32 noise: (2^24 - 1/2) / 2^24 rounds to 1.0."""
    return ((bits >> (sampler.NOISE_BITS - 24)).float() + 0.5) * (1.0 / (1 << 24))


def coarse_noise(bits):
    """24 bits of noise, kept inside (0, 1): too coarse to draw a 1e-8 token at its probability."""
    return ((bits >> (sampler.NOISE_BITS - 24)).double() + 0.5) * 2.0 ** -24


def accept_uniform_reused(seeds, positions, stream):
    """The acceptance test's uniform the same at every position (and so in every step)."""
    return real_noise(seeds, positions * 0 if stream == sampler.ACCEPT else positions, stream)


def draft_noise_for_acceptance(seeds, positions, stream):
    """The acceptance test reuses the uniform that drew the draft."""
    return real_noise(seeds, positions, sampler.DRAFT if stream == sampler.ACCEPT else stream)


def counters_xored(seeds, positions, stream, key):
    """Counters xored together, then hashed: (seed 1, position 2) and (seed 2, position 1) share
    their noise (as noise columns xored into the row hash did)."""
    return sampler._mix32(sampler._mix32((seeds ^ positions ^ stream) & sampler.MASK32) ^ key)


def top_p_on_every_row(mass_before, top_p):
    """top-p applied to rows with top_p = 1, where the mass before a tail token rounds to 1."""
    return mass_before < top_p[:, None]


REJECTION = lambda: test_rejection.test_batched_sampler_emits_p_and_accepts_as_predicted(False, {})
FAULTS = {
    "noise reaches 1.0": ("unit_interval", noise_reaching_one,
                          test_sampler_exact.test_noise_is_strictly_inside_the_unit_interval),
    "24-bit noise": ("unit_interval", coarse_noise, test_sampler_exact.test_noise_has_52_bits),
    "top-p applied to top_p = 1 rows": ("top_p_keeps", top_p_on_every_row,
                                        test_sampler_exact.test_top_p_one_keeps_every_token_top_k_keeps),
    "accept uniform reused across steps": ("uniform_noise", accept_uniform_reused, REJECTION),
    "residual skipped": ("next_token_weights", lambda p_next, q_next, rejected: p_next, REJECTION),
    "draft's noise reused for acceptance": ("uniform_noise", draft_noise_for_acceptance, REJECTION),
    "counters xored into one hash": ("_counter_hash", counters_xored,
                                     test_sampler_exact.test_distinct_draws_have_distinct_noise),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_suite_fails_on_a_broken_sampler(monkeypatch, fault):
    name, broken, test = FAULTS[fault]
    test()                                   # passes on the real sampler
    monkeypatch.setattr(sampler, name, broken)
    with pytest.raises(AssertionError):
        test()
