"""Dynamic K: the policy takes the goodput argmax of its tables, online acceptance rates follow
what the proposer really does, and whatever K the policy (or the queue switch-off) picks, output
stays lossless."""
import itertools
import json
import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanospec import LLM, SamplingParams
from conftest import PROMPTS, PROPOSERS, assert_no_leak, greedy, proposer_args
from nanospec.dynamic_k import (DynamicK, Profile, allocate, best_k, expected_time, interpolate, scaled_rates,
                                step_cost)
from nanospec.errors import NanospecError
from nanospec.estimators import AcceptanceRates, Calibration, SpanRates, StepTimes
from nanospec.dynamic_k import monotone_in_batch
from nanospec.profiler import main as profiler_main
from nanospec.proposer import Proposal
from nanospec.stats import Stats, accepted_positions
from nanospec.k_policy import QueueSwitch

# Step times in ms: batch 1 barely grows with K (bound by reading weights), batch 8 grows fast.
TABLE = Profile(batch_sizes=[1, 8], ks=[0, 2, 4], itl_s=[[10, 11, 12], [20, 40, 60]],
                acceptance=[0.8, 0.5, 0.4, 0.2])


def goodputs(profile: Profile, rates, batch: float) -> np.ndarray:
    """The oracle, written out with numpy: ITL over the batch (np.interp inside the table; past it,
    the line through the last two batch sizes, not below the last), then over K; argmax of AL / ITL."""
    b, itl = np.array(profile.batch_sizes, float), np.array(profile.itl_s, float)
    if batch <= b[-1] or len(b) == 1:
        at_batch = np.array([np.interp(batch, b, itl[:, j]) for j in range(len(profile.ks))])
    else:
        slope = (itl[-1] - itl[-2]) / (b[-1] - b[-2])
        at_batch = np.maximum(itl[-1] + slope * (batch - b[-1]), itl[-1])
    ks = np.arange(profile.max_k + 1)
    itl_k = np.interp(ks, profile.ks, at_batch)
    al = 1 + np.concatenate([[0], np.cumsum(rates[:profile.max_k])])
    return al / itl_k


@pytest.mark.parametrize("batch, rates, expected", [
    (1, TABLE.acceptance, 4),            # in the table: ITL flat in K, every draft pays
    (8, TABLE.acceptance, 1),            # in the table, K = 1 interpolated between K = 0 and 2
    (4, TABLE.acceptance, 2),            # batch interpolated between 1 and 8
    (16, TABLE.acceptance, 1),           # past the table: extrapolated along batch 1 -> 8
    (8, [0.05, 0.02, 0.01, 0.0], 0),     # drafts rarely accepted: plain decoding is best
    (1000, [0.3, 0.3, 0.3, 0.3], 0),     # far past the table, verifying costs more than it gains
])
def test_policy_picks_the_goodput_argmax(batch, rates, expected):
    """Worked by hand, e.g. batch 4: ITL = 14.29, 18.86, 23.43, 28.00, 32.57 ms for K = 0..4, AL = 1,
    1.8, 2.3, 2.7, 2.9, goodput 0.0700, 0.0955, 0.0982, 0.0964, 0.0890 tokens/ms: K = 2."""
    assert best_k(rates, TABLE.itl(batch)) == expected == int(np.argmax(goodputs(TABLE, rates, batch)))


def test_drafts_the_proposer_does_not_find_cost_nothing():
    """ITL for K = 0..4 verified drafts: 10, 10, 20, 20, 30 ms; a_i = 0.5, 0.4, 0.3, 0.2, AL = 1,
    1.5, 1.9, 2.2, 2.4. A draft model finds every draft (D(K) = K): goodput 0.100, 0.150, 0.095,
    0.110, 0.080 -> K = 1. An n-gram proposer that finds a match a quarter of the time (d_i = 0.25)
    verifies D(4) = 1 draft on average at K = 4. Over 64 requests that mean is what a step verifies:
    ITL = 10 ms whatever K, AL rises -> K = 4. A lone request verifies 0 drafts or K: the step takes
    0.75 x 10 + 0.25 ITL(K) = 10, 10, 12.5, 12.5, 15 ms, goodput 0.100, 0.150, 0.152, 0.176, 0.160
    -> K = 3."""
    itl, rates = [10, 10, 20, 20, 30], [0.5, 0.4, 0.3, 0.2]

    def time_at(x):
        return interpolate(list(range(5)), itl, x)
    assert best_k(rates, itl) == best_k(rates, step_cost(time_at, [1.0] * 4, batch=1)) == 1
    assert step_cost(time_at, [0.25] * 4, batch=64) == [10] * 5
    assert best_k(rates, step_cost(time_at, [0.25] * 4, batch=64)) == 4
    assert step_cost(time_at, [0.25] * 4, batch=1) == pytest.approx([10, 10, 12.5, 12.5, 15])
    assert best_k(rates, step_cost(time_at, [0.25] * 4, batch=1)) == 3
    observed = AcceptanceRates([0.5] * 4, [1.0] * 4)
    for _ in range(50):
        observed.observe([4] * 8, [1] * 8, [2] * 8)   # asked 4, found 2, accepted 1
    # (the prior's 4 pseudo-request-steps against ~200 observed ones keep it a hair off 0 and 1)
    assert observed.drafted() == pytest.approx([1, 1, 0, 0], abs=0.03)
    assert observed.rates() == pytest.approx([1, 0, 0, 0], abs=0.03)


def test_step_cost_is_the_mean_over_which_requests_find_drafts():
    """Batch 3, a match with probability q = 0.5, D(2) = 0.5 + 0.5 = 1 draft a request: a request
    that finds one drafts 2. Every subset of the 3 requests finds with probability 1/8; x = 2 |S| / 3."""
    def time_at(x):
        return x * x   # any curve: the expectation is over which requests found, not the curve's shape
    expected = sum(time_at(2 * len(found) / 3) / 8 for n in range(4)
                   for found in itertools.combinations(range(3), n))
    assert step_cost(time_at, [0.5, 0.5], batch=3)[2] == pytest.approx(expected)
    assert expected_time(time_at, 1.0, 0.5, batch=3, most=2) == pytest.approx(expected)
    # a large batch: the mean
    assert expected_time(time_at, 1.0, 0.5, batch=3, most=2, exact_up_to=2) == time_at(1.0)


@st.composite
def tables(draw):
    batch_sizes = [1] + sorted(draw(st.sets(st.integers(2, 300), max_size=4)))
    ks = [0] + sorted(draw(st.sets(st.integers(1, 10), min_size=1, max_size=5)))
    itl = [[draw(st.floats(1.0, 100.0)) for _ in ks] for _ in batch_sizes]
    rates = sorted((draw(st.floats(0.0, 1.0)) for _ in range(ks[-1])), reverse=True)
    return Profile(batch_sizes, ks, itl, rates)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(tables(), st.integers(1, 600))
def test_policy_is_the_argmax_on_random_tables(profile, batch):
    """Within float rounding of the oracle's best (ties go to the smaller K)."""
    goodput = goodputs(profile, profile.acceptance, batch)
    chosen = best_k(profile.acceptance, profile.itl(batch))
    assert goodput[chosen] >= goodput.max() * (1 - 1e-9)
    assert all(goodput[:chosen] < goodput[chosen] * (1 + 1e-9))
    assert DynamicK(profile).best_for(batch) == chosen


@st.composite
def per_request_tables(draw):
    """Rates per request (each non-increasing) and a step cost over the mean drafts per request, a
    polyline of any shape through x = 0..max_k."""
    batch, max_k = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rates = [sorted((draw(st.floats(0.0, 1.0)) for _ in range(max_k)), reverse=True) for _ in range(batch)]
    cost = [draw(st.floats(1.0, 100.0)) for _ in range(max_k + 1)]
    return rates, cost


@settings(max_examples=300, deadline=None)
@given(per_request_tables())
def test_per_request_allocation_is_the_argmax_over_every_k_per_request(table):
    """The oracle tries every (K_0, .., K_B-1) in 0..max_k^B."""
    rates, cost = table
    batch, max_k = len(rates), len(cost) - 1
    cost_at = lambda x, deepest: interpolate(list(range(max_k + 1)), cost, x)

    def goodput(ks):
        gain = batch + sum(sum(row[:k]) for row, k in zip(rates, ks))
        return gain / cost_at(sum(ks) / batch, max(ks))
    best = max(goodput(ks) for ks in itertools.product(range(max_k + 1), repeat=batch))
    assert goodput(allocate(rates, [1.0] * max_k, cost_at)) >= best * (1 - 1e-9)


def test_per_request_allocation_by_hand():
    """Two requests, a_i 0.9, 0.8 and 0.1, 0.05; a step costs 10 ms + 2 ms per draft a request
    verifies on average. K = (2, 0): (2 + 1.7) / 12 = 0.308 per ms; the best one K for both,
    K = 1: (2 + 1.0) / 12 = 0.25; K = 2: 3.85 / 14 = 0.275."""
    cost_at = lambda x, deepest: 10 + 2 * x
    assert allocate([[0.9, 0.8], [0.1, 0.05]], [1.0, 1.0], cost_at) == [2, 0]
    # no record: the shared rates
    assert scaled_rates([0.6, 0.5, 0.2], [0.0, 0.0]) == [0.6, 0.5, 0.2]
    # twice as good, capped at 1
    assert scaled_rates([0.6, 0.5, 0.2], [6.0, 2.0], prior_weight=2.0) == [1.0, 1.0, 0.4]
    assert scaled_rates([0.6, 0.5, 0.2], [0.0, 2.0], prior_weight=2.0) == [0.3, 0.25, 0.1]


def test_requests_that_verify_unalike_cost_a_padded_step_or_a_models_round_more_than_their_mean():
    """ITL(8, K) = 20 + 10 K, ITL(1, K) = 10 + 5 K (ms). One request of 8 verifying 4 drafts (0.5 on
    average): 25 ms where each row verifies its own (host drafts, a profile without `unalike`), the
    deepest's 60 where a step pads every row to it, a quarter of the way there (33.75) where the
    profile measured a CPU's attention padding so, and where a model drafts, at least a batch-1 round
    of 4 steps on a plain step (20 + 20). A budget priced by the mean gives that one request its
    drafts; priced by its round, none."""
    profile = Profile([1, 8], [0, 4], [[10, 30], [20, 60]], acceptance=[0.3, 0.2, 0.1, 0.05])
    measured = Profile([1, 8], [0, 4], [[10, 30], [20, 60]], acceptance=[0.3, 0.2, 0.1, 0.05], unalike=0.25)
    host, padded, rounds = (DynamicK(profile, per_request=True, probe_every=0, **options)
                            for options in ({}, dict(padded=True), dict(rounds=True)))
    attention = DynamicK(measured, per_request=True, probe_every=0)
    assert [p.profile_time(8, 0.5, 4) for p in (host, padded, attention, rounds)] == [25, 60, 33.75, 40]
    assert all(p.profile_time(8, 2, 2) == p.profile_time(8, 2) == 40 for p in (host, padded, rounds))
    requests = [object() for _ in range(8)]
    for policy in (host, rounds):
        policy.records[id(requests[0])] = [40.0, 10.0]   # it accepted four times what the rates expected
    assert host.choose_per_request(requests)[0] > 0
    assert rounds.choose_per_request(requests) == [0] * 8


def test_a_request_that_keeps_rejecting_gets_a_smaller_k():
    """Batch 2 with a profile where K = 2 is best for both: one request accepts every draft, the
    other none. Per request, the second falls to K = 0 and the first climbs to max_k; one K for the
    batch stays between."""
    profile = Profile([1, 2], [0, 4], [[10, 12], [10, 14]], acceptance=[0.5, 0.3, 0.1, 0.05])
    policy = DynamicK(profile, per_request=True, probe_every=0)
    requests = [object(), object()]   # the policy keeps their records
    assert policy.choose_per_request(requests) == [2, 2]
    for _ in range(30):
        ks = policy.choose_per_request(requests)
        policy.observe(ks, [ks[0], 0], requests=requests)
    assert policy.choose_per_request(requests) == [4, 0]


def test_monotone_in_batch_takes_the_running_maximum_over_the_batch_only():
    assert monotone_in_batch([[3, 2, 4], [1, 5, 2]]) == [[3, 2, 4], [3, 5, 4]]


def simulate_step(rng, conditional, batch, k):
    """A proposer whose draft i is accepted with probability conditional[i] once drafts 0..i-1 were."""
    accepted = []
    for _ in range(batch):
        n = 0
        while n < k and rng.random() < conditional[n]:
            n += 1
        accepted.append(n)
    return accepted


def test_calibration_learns_what_a_drafters_confidence_is_worth_at_each_position():
    """With no record a node's a is its drafter's confidence c. Nodes given c = 1 at position 0 and
    accepted every other step come to be worth about 0.5; at position 1, never accepted, about 0; a
    position with no record takes its bin's (a quarter accepted there), and a row never increases.
    Another bin keeps its c."""
    calibration = Calibration(8, decay=1.0)
    assert calibration.rates([1.0, 0.95, 0.3]) == [1.0, 0.95, 0.3]
    for step in range(400):
        calibration.observe([[1.0, 1.0]], [2], [[0] if step % 2 else []])
    first, second, third = calibration.rates([1.0, 1.0, 1.0])
    assert first == pytest.approx(0.5, abs=0.01) and second == pytest.approx(0.0, abs=0.01)
    assert third == second   # its bin's record alone says 0.25: the row does not climb back
    assert calibration.rates([1.0, 1.0][:1] + [0.35]) == [first, 0.35]
    assert calibration.rates([0.3, 0.35]) == [0.3, 0.3]


def test_the_budget_verifies_a_confident_drafters_drafts_by_their_worth():
    """Asked for max_k, a confident drafter's nodes are trimmed as allocate places K's. A step costs
    10 ms + 2 ms per draft a request verifies: a node worth 0.9 pays (1.9 tokens in 12 ms beats 1 in
    10), one worth 0.1 after it does not (2.0 in 14). Where drafts cost nothing, every node is kept.
    Calibration decides, not the raw confidence: once the c = 0.9 nodes are never accepted, none are
    kept. A tree keeps its first nodes with their parents; a request's own cap (its K) holds."""
    costly = Profile([1, 8], [0, 4], [[10, 18], [20, 60]], acceptance=[0.5] * 4)
    free = Profile([1, 8], [0, 4], [[10, 10], [20, 20]], acceptance=[0.5] * 4)
    tree = Proposal([3], [[7, 8, 9]], parents=[[-1, 0, 0, 1]], confidence=[[0.9, 0.1, 0.05]])
    request = [object()]
    for profile, kept in ((costly, 1), (free, 3)):
        policy = DynamicK(profile, per_request=True, probe_every=0, confident=True)
        assert policy.choose(request) == [4]
        ks, trimmed = policy.trim(request, [4], tree)
        assert ks == [kept] and trimmed.num_draft == [kept] and trimmed.host_drafts == [[7, 8, 9][:kept]]
        assert trimmed.parents == [[-1, 0, 0, 1][:kept + 1]]
        assert trimmed.confidence == [[0.9, 0.1, 0.05][:kept]]
        assert policy.choose(request) == [min(4, 2 * kept + 1)]   # asked next: twice what was kept, and one
        policy.trim(request, [4], Proposal([0], [[]], confidence=[[]]))   # no draft found: the ask stays
        assert policy.choose(request) == [min(4, 2 * kept + 1)]
    assert policy.trim(request, [2], tree)[0] == [2]   # its cap
    policy = DynamicK(costly, per_request=True, probe_every=0, confident=True, warmup_steps=0)
    for _ in range(30):
        ks, trimmed = policy.trim(request, [4], tree)
        policy.observe(ks, [0], trimmed.num_draft, requests=request)
    assert policy.trim(request, [4], tree)[0] == [0]
    not_confident = DynamicK(costly, per_request=True, probe_every=0)
    assert not_confident.trim(request, [4], tree) == ([4], tree)
    switched = QueueSwitch(DynamicK(costly, per_request=True, probe_every=0, confident=True), max_queue=4)
    assert switched.trim(request, [4], tree)[0] == [1]   # the queue switch passes trim to its budget
    chain = Proposal([3], [[7, 8, 9]], confidence=[[0.9, 0.1, 0.05]]).keep([1])
    assert (chain.host_drafts, chain.parents, chain.tree, chain.num_draft) == ([[7]], None, None, [1])
    policy.forget(request[0])
    assert policy.choose(request) == [4]   # a request it forgot is asked for its cap again


def test_calibration_counts_a_trees_nodes_on_the_accepted_path():
    """A tree's accepted positions are its path's nodes (stats.accepted_positions): node 2 (position
    1) accepted, node 1 (position 0) not."""
    calibration = Calibration(4, decay=1.0, prior_weight=1.0)
    for _ in range(50):
        calibration.observe([[0.5, 0.5]], [2], accepted_positions([1], [[0, 2]]))
    first, second = calibration.rates([0.5, 0.5])
    assert first < 0.05 and second == first   # the row never increases: node 2 is no likelier than node 1
    assert calibration.accepted[1][5] == 50 and calibration.accepted[0][5] == 0


def test_a_trees_positions_are_its_nodes_best_first():
    """A tree's draft position i is its node i + 1 (the (i + 1)-th most likely), accepted where the
    accepted path holds it; a chain's are its first `accepted`. Read as a chain's, the paths [1, 3]
    and [2] would count positions 0, 1 and 0: the rates and the stats both tell them apart."""
    chains, trees = AcceptanceRates([0.5] * 4, decay=1.0), AcceptanceRates([0.5] * 4, decay=1.0)
    chains.observe([4, 4], [2, 1])
    trees.observe([4, 4], [2, 1], paths=[[1, 3], [2]])
    assert chains.accepted == [2, 1, 0, 0]
    assert trees.accepted == [1, 1, 1, 0]
    stats = Stats()
    stats.record(4, [4, 4], [4, 3], [2, 1], paths=[[1, 3], [2]])
    assert (stats.offered_per_position, stats.drafted_per_position, stats.accepted_per_position) == \
        ([2, 2, 2, 2], [2, 2, 2, 1], [1, 1, 1])
    assert stats.accepted_tokens == 3


def test_online_rates_converge_to_what_the_proposer_accepts_and_follow_a_change():
    rng = random.Random(0)
    prior = [0.9, 0.8, 0.7, 0.6]
    rates = AcceptanceRates(prior, decay=0.995)
    for workload in ([0.6, 0.5, 0.9, 0.5], [0.95, 0.9, 0.3, 0.8]):
        truth = np.cumprod(workload)    # a_i = P(drafts 0..i all accepted)
        for _ in range(3000):
            rates.observe([4] * 8, simulate_step(rng, workload, 8, 4))
        assert np.allclose(rates.rates(), truth, atol=0.04), (rates.rates(), truth)


def test_spans_follow_each_request_across_steps_by_hand():
    rates = SpanRates([0.5] * 3, decay=1.0)
    a, b = object(), object()
    # a: all 3 right, goes on (4 tokens); b: a span of 1
    rates.observe([3, 3], [3, 1], [3, 3], requests=[a, b])
    # a: 4 + 2 = 6, ends; b: found nothing, a span of 0
    rates.observe([3, 3], [2, 0], [3, 0], requests=[a, b])
    rates.observe([2], [2], [2], requests=[b])               # a has left (nothing open); b goes on (3 tokens)
    rates.observe([0], [0], [0], requests=[b])               # no drafts: b's span ends where it is, as 2
    assert {n: c for n, c in enumerate(rates.spans) if c} == {0: 1, 1: 1, 2: 1, 6: 1}
    # 13 tokens in 4 spans; at K = 1 they take 1 + 1 + 2 + 4 steps, at K = 3 1 + 1 + 1 + 2
    assert rates.acceptance_length(1) == 13 / 8 and rates.acceptance_length(3) == 13 / 5
    # blended with the profile, 4 spans each
    assert rates.rates()[0] == pytest.approx((4 * (13 / 8 - 1) + 4 * 0.5) / 8)
    # past the accepted on span-ending steps: b offered 1, 2 (found) then 0, 1, 2 (none); a offered 2 (found)
    assert rates.past_accepted == [1, 2, 3] and rates.past_found == [0, 1, 2]
    # blended with the profile's d_i = 1
    found_past = [(0 + 4) / (1 + 4), (1 + 4) / (2 + 4), (2 + 4) / (3 + 4)]
    # K = 1: spans 0, 1, 2, 6 verify e_0, 1, 1 + e_0, 3 + e_0 drafts in 8 steps
    assert rates.drafts(1) == pytest.approx((3 * found_past[0] + 5) / 8)
    rates.decay = 0.9
    for _ in range(300):                                     # K = 0 for a long time: every span decays away
        rates.observe([0], [0], [0], requests=[b])
    assert rates.rates() == [0.5] * 3
    left = SpanRates([0.5], decay=1.0)
    left.observe([1], [1], requests=[a])
    # a left with 2 tokens open: a span of 1 and its last
    left.observe([1], [1], requests=[b])
    assert {n: c for n, c in enumerate(left.spans) if c} == {1: 1}


def test_a_copy_in_progress_counts_before_it_ends():
    """An open span of n tokens counts as a span of n - 1 until it ends. Five spans of 0, then ten
    steps that accept both of K = 2's drafts: an open span of 30 tokens, counted as 29. AL(6) =
    (5 + 30) / (5 + 29 // 7 + 1) = 3.5 and AL(2) = 35 / (5 + 29 // 3 + 1) = 35 / 15 already, not the
    1 that the five ended spans alone say."""
    rates, a = SpanRates([0.5] * 6, decay=1.0), object()
    for _ in range(5):
        rates.observe([2], [0], [2], requests=[a])
    assert rates.seen() == [(0, 5)] and rates.acceptance_length(6) == 1
    for _ in range(10):
        rates.observe([2], [2], [2], requests=[a])
    assert rates.seen() == [(0, 5), (29, 1)]
    assert rates.acceptance_length(6) == 3.5 and rates.acceptance_length(2) == 35 / 15
    rates.observe([2], [1], [2], requests=[a])   # it ends: 30 + 1
    assert rates.seen() == [(0, 5), (31, 1)]


def test_at_batch_1_the_policy_follows_a_copy_up_while_it_goes_on():
    """The policy at batch 1: ten steps that accept a draft every other step take it down to K = 1,
    then a copy accepts every draft. It climbs to K = 6 within ten steps, long before the copy ends
    (counting ended spans only, it stayed at K = 1-2 for the whole copy)."""
    profile = Profile(batch_sizes=[1], ks=list(range(7)), itl_s=[[10, 13, 14, 15, 16, 17, 18]],
                      acceptance=[0.5, 0.3, 0.2, 0.1, 0.05, 0.02], drafted=[0.8] * 6)
    policy, request, chosen = DynamicK(profile, probe_every=0, spans=True), object(), []
    for step in range(30):
        k = policy.best_for(1)
        chosen.append(k)
        policy.observe([k], [min(k, step % 2) if step < 10 else k], [k], requests=[request])
    assert max(chosen[8:12]) <= 2 and chosen[-8:] == [6] * 8 and 6 in chosen[10:21]


def run_policy(policy, steps, accept, step_ms=None, batch=8):
    """Drive the policy like the engine: choose, simulate the step, observe. Returns the K's chosen
    on the steps that were not probes."""
    rng, chosen = random.Random(0), []
    for step in range(1, steps + 1):
        k = policy.best_for(batch)
        if policy.last_probe != step:
            chosen.append(k)
        policy.observe([k] * batch, simulate_step(rng, accept, batch, k),
                       seconds=None if step_ms is None else step_ms[k] * rng.uniform(0.8, 1.2))
    return chosen


@pytest.mark.parametrize("probe_every, expected", [(8, 4), (0, 0)])
def test_probes_find_a_workload_that_accepts_far_more_than_the_profile(probe_every, expected):
    """The profile's prompts barely accept drafts (K = 0 is best at batch 8); the workload accepts
    each next draft with probability 0.9: AL = 1, 2.71, 4.10 at K = 0, 2, 4 over 20, 24, 28 ms, so
    K = 4 is best. Probes (a neighbour of K* every 8th step) find it; without them the policy never
    drafts, never observes, and stays at K = 0."""
    profile = Profile([1, 8], [0, 2, 4], [[10, 11, 12], [20, 24, 28]], acceptance=[0.05, 0.01, 0.0, 0.0])
    chosen = run_policy(DynamicK(profile, probe_every=probe_every), 400, [0.9] * 4)
    assert chosen[0] == 0 and set(chosen[-40:]) == {expected}


@pytest.mark.parametrize("probe_every, expected", [(8, 1), (0, 4)])
def test_measured_step_times_correct_a_profile_that_makes_large_k_look_cheap(probe_every, expected):
    """The profile says batch 8 verifies 4 drafts almost for free (20, 21, 22, 23, 24 ms): with
    a_i = 0.6, 0.4, 0.3, 0.2, K = 4 (AL 2.5). The real steps take 20, 24, 32, 44, 60 ms (+-20%
    noise): goodput 0.050, 0.067, 0.063, 0.052, 0.042 per ms, K = 1 is best (K = 2 within 6%, so
    noise makes the policy visit it too). Measured step times and probes downward walk the policy
    there; without probes it only sees K = 4, the steps look uniformly slower than the profile, and
    it stays."""
    profile = Profile([1, 8], [0, 4], [[10, 10], [20, 24]], acceptance=[0.6, 0.4, 0.3, 0.2])
    conditional = [0.6, 0.4 / 0.6, 0.3 / 0.4, 0.2 / 0.3]
    chosen = run_policy(DynamicK(profile, probe_every=probe_every), 600, conditional,
                        step_ms=[20, 24, 32, 44, 60])
    assert chosen[0] == 4 and Counter(chosen[-100:]).most_common(1)[0][0] == expected, Counter(chosen[-100:])


def test_the_policy_goes_by_the_profile_while_it_warms_up_then_by_what_it_observes():
    """Batch 8, the profile's rates 0.9 .. 0.6: K = 4. Every step verifies 4 drafts per request
    and none is accepted: without a warm-up the policy leaves K = 4 after one step; with four warm-up
    steps it keeps the profile's K = 4 for four steps and then, on the same evidence, chooses what
    the policy without a warm-up chooses by then."""
    profile = Profile([1, 8], [0, 4], [[10, 10], [20, 24]], acceptance=[0.9, 0.8, 0.7, 0.6])
    chosen = {}
    for warmup in (0, 4):
        policy, chosen[warmup] = DynamicK(profile, probe_every=0, warmup_steps=warmup), []
        for _ in range(8):
            chosen[warmup].append(policy.best_for(8))
            policy.observe([4] * 8, [0] * 8, seconds=0.1)   # 4x the profile's time: not used while warming up
        assert chosen[warmup][:max(warmup, 1)] == [4] * max(warmup, 1)
    assert chosen[0][1] < 4 and chosen[4][4:] == chosen[0][4:]


def test_step_time_ratio_is_a_line_in_the_drafts_fitted_per_batch_size():
    times = StepTimes(decay=1.0, prior_weight=2.0)
    assert times.ratio(4, 0) == times.ratio(4, 3) == 1.0   # nothing seen: the profile as it is
    times.observe(1, 2.0, 1.5)          # one step: the level is the overall mean (1.5 too), the slope 0
    assert times.ratio(1, 0) == times.ratio(1, 5) == 1.5
    times.observe(1, 4.0, 2.5)          # a second: level (1.5 + 2.5 + 2 * 2) / 4 at x = 3, slope 1 / (2 + 2)
    assert times.ratio(1, 3) == pytest.approx(2.0) and times.ratio(1, 5) == pytest.approx(2.0 + 2 * 0.25)
    for _ in range(400):                # batch 4: the real steps cost 1.2 + 0.3 x the profile's
        for x in (0, 1, 2, 3, 4):
            times.observe(4, x, 1.2 + 0.3 * x)
    assert [times.ratio(4, x) for x in (0, 2.5, 4)] == pytest.approx([1.2, 1.95, 2.4], rel=0.01)
    # unseen: the mean over every step
    assert times.ratio(16, 3) == pytest.approx((1.5 + 2.5 + 400 * 5 * 1.8) / 2002)


def test_rates_blend_the_profile_with_what_is_observed_and_come_back_after_a_long_pause():
    prior = [0.9, 0.6, 0.3]
    rates = AcceptanceRates(prior, decay=1.0, prior_weight=2.0)
    assert rates.rates() == prior
    rates.observe([1, 1], [0, 0])          # position 0 offered twice, both rejected
    # (0 + 2 * 0.9) / (2 + 2); positions never offered follow the profile's shape from there
    assert rates.rates() == pytest.approx([0.45, 0.45 * 0.6 / 0.9, 0.45 * 0.6 / 0.9 * 0.5])
    rates.observe([2, 2], [2, 2])          # both offered two drafts, both accepted
    first = (2 + 2 * 0.9) / (4 + 2)
    second = (2 + 2 * first * 0.6 / 0.9) / (2 + 2)
    assert rates.rates() == pytest.approx([first, second, second * 0.5])
    rates.decay = 0.9
    for _ in range(300):                   # K = 0 for a long time: every count decays away
        rates.observe([0, 0], [0, 0])
    assert rates.rates() == pytest.approx(prior)


def write_profile(path, batch_sizes, ks, itl, acceptance) -> str:
    Profile(batch_sizes, ks, itl, acceptance).save(str(path))
    return str(path)


@pytest.fixture
def varying_profile(tmp_path):
    """K* = 8 alone, about 3 at batch 4, 0 from batch 8 on (with the profile's high acceptance)."""
    return write_profile(tmp_path / "profile.json", [1, 4, 8], [0, 1, 8],
                         [[1.0, 1.0, 1.0], [1.0, 1.4, 6.0], [1.0, 2.5, 20.0]], [0.9] * 8)


TREES = {"suffix@tree": ("suffix", dict(speculative_topk=3)),
         "draft@tree": ("draft", dict(speculative_topk=2, speculative_num_steps=3)),
         "eagle1@tree": ("eagle1", dict(speculative_topk=3, speculative_num_steps=2))}


def spec_args(spec_models, name: str) -> dict:
    """A proposer's settings; NAME@tree: its trees, whose K is their nodes."""
    base, tree = TREES.get(name, (name, {}))
    return {**proposer_args(spec_models, base), **tree}


@pytest.mark.parametrize("per_request", [False, True])
@pytest.mark.parametrize("name", PROPOSERS + list(TREES))
def test_dynamic_k_greedy_output_equals_plain_greedy(spec_models, plain_greedy, varying_profile, name,
                                                     per_request):
    """The batch shrinks from 8 to 1 as requests finish, and online rates replace the profile's:
    K changes from step to step (and from request to request), output does not. With trees, K is a
    request's nodes: its tree's K most likely. The hybrid takes no profile and no K per request: it
    prices its plans (hybrid.StepPlans), which change instead."""
    args = dict(device="cpu", dtype="float32", kv_cache_gb=0.05, dynamic_k=True,
                **spec_args(spec_models, name))
    hybrid = name.startswith("hybrid")
    if hybrid and per_request:
        with pytest.raises(NanospecError, match="per_request_k is not for the hybrid"):
            LLM(spec_models["target"], per_request_k=True, **args)
        return
    llm = LLM(spec_models["target"], **args) if hybrid else \
        LLM(spec_models["target"], profile=varying_profile, per_request_k=per_request, **args)
    outs = llm.generate(PROMPTS, [greedy(max_tokens=6 + 2 * i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outs] == [plain_greedy[p][:6 + 2 * i] for i, p in enumerate(PROMPTS)]
    # a confident drafter's budget asks for max_k and keeps what is worth verifying: each request's K
    confident = per_request and llm.engine.proposer.confident
    counted = llm.stats["request_k" if confident else "chosen_k"]
    chosen = {k for per_batch in counted.values() for k in per_batch}
    if hybrid:
        chosen = {plan for plan, steps in llm.engine.proposer.plans.chosen.items() if steps}
    assert len(chosen) >= 2, llm.stats["chosen_k"]
    assert_no_leak(llm)


@pytest.mark.parametrize("name", ["suffix@tree", "eagle1@tree"])
def test_the_budget_keeps_each_requests_cap_on_trees(spec_models, plain_greedy, varying_profile, name):
    """The budget placed request by request over trees: a request's num_speculative_tokens caps its
    nodes (0: none), and the queue-size switch-off, wrapped around it, still turns drafting off while
    more than 6 requests wait or run (the requests end one by one)."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, dynamic_k=True,
              per_request_k=True, profile=varying_profile, speculative_disable_queue_size=6,
              **spec_args(spec_models, name))
    engine, caps = llm.engine, [0, 2, None]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True,
                             num_speculative_tokens=caps[i % 3]) for i in range(len(PROMPTS))]
    reqs = [engine.new_request(i, p, llm.encode_prompt(p), params[i]) for i, p in enumerate(PROMPTS)]
    engine.add_requests(reqs)
    drafting_at = set()
    while engine.scheduler.has_work():
        queue = len(engine.scheduler.waiting) + len(engine.scheduler.running)
        drafted = engine.stats.drafted_tokens
        engine.step()
        if engine.stats.drafted_tokens > drafted:
            drafting_at.add(queue)
    assert [r.output_ids for r in reqs] == [plain_greedy[p][:6 + 2 * i] for i, p in enumerate(PROMPTS)]
    assert drafting_at and max(drafting_at) <= 6
    assert all(r.drafted == 0 for r in reqs[::3])
    assert all(len(r.drafted_per_position) <= 2 for r in reqs[1::3])
    assert_no_leak(llm)


def test_queue_switch_off_turns_speculation_off_above_the_threshold_and_on_below(spec_models, plain_greedy):
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, ngram=True,
              num_speculative_tokens=4, max_num_seqs=3, speculative_disable_queue_size=3)
    engine = llm.engine
    reqs = [engine.new_request(i, p, llm.encode_prompt(p), greedy(max_tokens=4 + 2 * i)) for i,
            p in enumerate(PROMPTS)]
    engine.add_requests(reqs)
    seen = set()
    while engine.scheduler.has_work():
        queue = len(engine.scheduler.waiting) + len(engine.scheduler.running)
        engine.step()
        assert engine.step_k == (0 if queue > 3 else 4), queue
        seen.add(engine.step_k)
    assert seen == {0, 4}
    assert [r.output_ids for r in reqs] == [plain_greedy[p][:4 + 2 * i] for i, p in enumerate(PROMPTS)]


def test_profile_command_writes_a_profile_that_generate_uses(checkpoints, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "profile.json"
    assert profiler_main(["--target", checkpoints["llama3"], "--ngram", "--prompts", str(prompts),
                           "--batch-sizes", "1,3", "--max-k", "3", "--steps", "1", "--max-new-tokens", "6",
                           "--device", "cpu", "--out", str(out)]) == 0
    profile = Profile.load(str(out))
    assert profile.batch_sizes == [1, 3] and profile.ks == [0, 1, 2, 3] and len(profile.acceptance) == 3
    assert profile.meta["target"] == checkpoints["llama3"] and profile.meta["proposer"] == "ngram"
    assert profile.meta["device"] and "--ngram" in profile.meta["command"]
    with pytest.warns(UserWarning, match="measured K up to 3, so K stays at most 3 \\(not 8\\)"):
        llm = LLM(checkpoints["llama3"], device="cpu", ngram=True, dynamic_k=True, profile=str(out),
                  kv_cache_gb=0.05)   # (K 8 asked by default: the profile's range was kept silently)
    assert llm.engine.k_policy.max_k == 3
    assert llm.generate("The quick brown", greedy(max_tokens=5))[0].token_ids


def test_profile_times_steps_that_verify_exactly_k_drafts(checkpoints, monkeypatch):
    """Random prompts give n-gram almost no matches: without ExactlyK most timed steps would verify
    no draft at all and every K would cost what K = 0 costs. The profiler times engines it builds
    (one per K, taking turns), and leaves the LLM's own engine untouched."""
    from nanospec.engine import Engine
    from nanospec.dynamic_k import MIN_STEPS, time_decode_steps
    llm = LLM(checkpoints["llama3"], device="cpu", ngram=True, num_speculative_tokens=3, max_num_seqs=2,
              kv_cache_gb=0.05)
    stepped, step = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: (stepped.append(self), step(self))[1])
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(12)] for _ in range(2)]
    assert len(time_decode_steps(llm.engine, prompts, 2, [0, 3], steps=2)) == 2
    by_k = {e.k_policy.k: e for e in stepped}
    assert set(by_k) == {0, 3} and llm.engine not in stepped
    assert by_k[3].stats.drafted_per_position == [2 * 3] * 3   # K = 3: 3 steps x 2 requests, each at 3 drafts
    assert by_k[0].stats.drafted_tokens == 0
    assert llm.stats["steps"] == 0 and not llm.engine.scheduler.has_work()
    # with a time cap that every round passes: the warm-up and MIN_STEPS rounds, not `steps`
    stepped.clear()
    time_decode_steps(llm.engine, prompts, 2, [0, 3], steps=9, most_seconds=0.0)
    by_k = {e.k_policy.k: e for e in stepped}
    assert by_k[3].stats.drafted_per_position == [2 * (MIN_STEPS + 1)] * 3


def test_without_a_profile_a_quick_one_is_measured(checkpoints):
    llm = LLM(checkpoints["llama3"], device="cpu", ngram=True, dynamic_k=True, num_speculative_tokens=2,
              max_num_seqs=2, kv_cache_gb=0.05)
    assert llm.profile.batch_sizes == [1, 2] and llm.profile.ks == [0, 1, 2]
    assert 0 <= llm.profile.unalike <= 1   # one request of 2 at K = 2, the other at none
    assert llm.profile_seconds > 0 and llm.stats["steps"] == 0   # profiling leaves no stats behind
    allocator = llm.engine.kv_cache.allocator
    assert not llm.engine.scheduler.has_work() and allocator.num_free == allocator.num_blocks


@pytest.mark.parametrize("content, match", [
    ("{", "is not a dynamic-K profile"),
    (json.dumps({"batch_sizes": [2, 4], "ks": [0, 1], "itl_s": [[1, 1], [1, 1]], "acceptance": [0.5]}),
     "ascend from 1"),
    (json.dumps({"batch_sizes": [1], "ks": [1, 2], "itl_s": [[1, 1]], "acceptance": [0.5, 0.5]}),
     "ks must ascend from 0"),
    (json.dumps({"batch_sizes": [1], "ks": [0, 2], "itl_s": [[1, 1]], "acceptance": [0.5]}),
     "acceptance must hold 2"),
    (json.dumps({"batch_sizes": [1], "ks": [0, 1], "itl_s": [[1, 0]], "acceptance": [0.5]}), "positive"),
    (json.dumps({"batch_sizes": [1], "ks": [0, 1], "itl_s": [[1, 2]], "acceptance": [0.5], "unalike": 2}),
     r"unalike must be in \[0, 1\]"),
])
def test_bad_profile_is_one_clear_error(tmp_path, content, match):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(NanospecError, match=match):
        Profile.load(str(path))


def test_a_step_costs_what_its_bucket_costs():
    """With the engine's batch buckets, a batch of 5 is priced (and its observed time learned) at
    the bucket of 8 it is padded to, not between the profile's points 4 and 8."""
    profile = Profile([1, 4, 8], [0, 1], [[1.0, 2.0], [2.0, 3.0], [4.0, 6.0]], [0.5])
    padded, unpadded = DynamicK(profile, buckets=[1, 2, 4, 8]), DynamicK(profile)
    assert padded.profile_time(5, 1) == padded.profile_time(8, 1) == 6.0
    assert unpadded.profile_time(5, 1) == pytest.approx(3.75)
    padded.observe([1] * 5, [0] * 5, seconds=12.0)   # twice the profile's time for its bucket
    assert padded.step_times.ratio(8, 1) > 1 and padded.bucket(9) == 9


def test_the_upkeep_harness_holds_a_drafter_at_k_0(spec_models, capsys):
    """benchmarks.proposer_upkeep on a tiny checkpoint: both engines emit the same tokens, and the held
    one drafted nothing."""
    from benchmarks import proposer_upkeep
    assert proposer_upkeep.main(["--target", spec_models["target"], "--eagle", spec_models["eagle1"],
                                 "--batch-size", "2", "--max-prompts", "3", "--max-new-tokens", "6",
                                 "--repeats", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["same_tokens"], r["held_drafted"]) for r in report["repeats"]] == [(True, 0), (True, 0)]
    assert report["held_over_plain_median"] > 0
    assert proposer_upkeep.main(["--target", spec_models["target"]]) == 2
    assert "--eagle HEAD or --draft PATH" in capsys.readouterr().err


@pytest.mark.parametrize("drafter, k", [("eagle1", 2), ("draft", 3)])
def test_the_confidence_harness_counts_every_draft_by_its_confidence(spec_models, capsys, drafter, k):
    """benchmarks.draft_confidence on a tiny checkpoint: every verified draft is counted once, at its
    position and confidence bin (the drafted counts add up to the engine's drafted tokens: no draft
    lost or counted twice), and the step's parts are timed."""
    from benchmarks import draft_confidence
    flag = {"eagle1": ["--eagle", spec_models["eagle1"]], "draft": ["--draft", spec_models["draft"]]}[drafter]
    assert draft_confidence.main(["--target", spec_models["target"], *flag, "--k", str(k),
                                  "--batch-size", "2", "--max-prompts", "3", "--max-new-tokens", "6"]) == 0
    report = json.loads(capsys.readouterr().out)
    cells = report["by_position_and_confidence"]
    assert {c["position"] for c in cells} <= set(range(1, k + 1))
    assert all(0 <= c["accepted"] <= c["drafted"] for c in cells)
    assert sum(c["drafted"] for c in cells) == report["drafted_tokens"] > 0
    assert sum(c["accepted"] for c in cells) == report["accepted_tokens"]
    parts = ("step", "round", "verify", "k0_step", "k0_verify")
    assert all(report["step_ms_median"][part] > 0 for part in parts)
    assert draft_confidence.main(["--target", spec_models["target"]]) == 2
    assert "--eagle HEAD or --draft PATH" in capsys.readouterr().err
