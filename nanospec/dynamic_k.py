"""Dynamic K: choose the number of speculative tokens per step by goodput.

A decode step of B requests that each verify K drafts takes ITL(B, K) seconds and gains each
request AL(K) tokens on average, where

    AL(K) = 1 + sum_{i<K} a_i

a_i being the probability that draft i is accepted. Draft i is accepted only if drafts 0..i-1 were,
so a_i is the probability of a run of at least i + 1 accepted drafts, and the expected run is the sum
of those tail probabilities; the 1 is the target's own token (recovered or bonus), which every step
emits. Goodput is AL(K) / ITL(B, D(K)) (in expectation over the drafts found: step_cost); the
policy takes K* = argmax over K = 0..K_max (K = 0 is plain decoding, AL = 1). Speculation pays
while the step is bound by reading weights (ITL barely grows with K) and costs once verifying
B (K + 1) tokens makes it compute-bound: K* falls with the batch.

D(K) = sum_{i<K} d_i is the number of drafts a request really verifies when asked for K, d_i being
the probability that the proposer finds a draft i at all: 1 for a draft model or EAGLE, less for
n-gram, which drafts nothing where it finds no match, and the step then costs what a smaller K costs.
For n-gram, a_i and d_i counted per step favour the K they were counted at (a copy takes fewer steps
at a larger K, so fewer of the steps fall in one); they are read off the spans of text it drafts
right instead, which do not depend on K (SpanRates).

Per request (`per_request=True`): requests differ (an n-gram request that copies its prompt accepts
five drafts a step, one that writes new text almost none), and a step's time depends on how many
drafts it verifies in all, not on whose. So drafts go where they are accepted: request b gets K_b,
chosen to maximise sum_b AL_b(K_b) / ITL(B, mean_b D(K_b)), AL_b from the shared rates scaled by
what request b accepted lately next to what those rates expected of it (allocate, scaled_rates).

Trees (tree.py, `speculative_topk`): a request's K is its tree's nodes, its K most likely (trees number
their nodes best first, so a smaller K keeps a prefix), and a_i is the probability that node i + 1 lies on
the accepted path. The path's length counts its nodes, so AL(K) = 1 + sum_{i<K} a_i holds as for a chain,
a_i need not be a run's tail, and the profile times trees of K nodes. So the policy is a verification
budget: a step's drafts verified in all, and where (with per_request: the most likely nodes of the
requests most likely to accept them first), by goodput; a chain per request is its special case.

The drafter's confidence: a drafter whose drafts come with its own probability that each node lies on
the accepted path (Proposer.confident: suffix decoding's share of past continuations through a node) is
asked for about twice the nodes it kept for a request last (its cap at first), and the budget keeps,
across the batch, the nodes worth verifying (trim): each node's a_i is that probability calibrated
online against what such nodes were accepted (Calibration, per draft position and bin of confidence),
placed by goodput as allocate places K's. A request's K is then the nodes kept for it.

ITL(B, K) comes from a profile measured on this machine with the real engine, proposer included,
every request verifying exactly K drafts (`python -m nanospec.profiler ...`, or a quick one
at start-up), interpolated linearly between the profiled batch sizes and K values (and at the
fractional D(K)). Neither half of goodput is trusted blindly once the engine runs: after a
warm-up of a few decode steps on the profile alone, a_i and d_i follow what the running requests
accept (AcceptanceRates, or SpanRates), and ITL is corrected by how long the engine's own steps take next to
what the profile predicts (StepTimes: the profile's prompts are not the workload's, contexts grow, a
shared machine slows down). Every probe_every-th step (more rarely while K* holds) tries a
neighbour of K* (K* + 1, then K* - 1), so both corrections also see the K's the policy does not pick.
The choice is a few hundred floating-point operations on the host per step (a few thousand with
spans): no device sync (the step time is read after the step's one device-to-host copy), nothing
per vocabulary.

    python -m nanospec.profiler [--target ...] --ngram --out profile.json
"""
from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from nanospec.cuda_graph import MAX_GRAPH_BATCH, GraphKey, step_buckets
from nanospec.engine import Engine
from nanospec.sampling_params import SamplingParams
from nanospec.errors import NanospecError
from nanospec.estimators import AcceptanceRates, Calibration, SpanRates, StepTimes
from nanospec.k_policy import KPolicy, StaticK
from nanospec.stats import accepted_positions


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """y(x) on the polyline through (xs[i], ys[i]) (xs ascending). Past the last point it follows
    the last segment (a step's time keeps growing with the batch), never below the last point."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    return max(y, ys[-1]) if x > xs[-1] else y


@dataclass
class Profile:
    """ITL over a grid of batch sizes x K, and the acceptance, as `python -m nanospec.profiler` measures
    them; the fields in the order save() writes them (the key order of the profiles in bench_results/)."""
    batch_sizes: list[int]          # ascending, from 1
    ks: list[int]                   # ascending, from 0
    itl_s: list[list[float]]        # [batch][k]: seconds per decode step
    acceptance: list[float]         # a_i for i < max(ks), greedy, over the profile's prompts
    drafted: list[float] | None = None         # d_i, the same way (None: the proposer always drafts)
    # where requests verify unalike, the share of the time between their mean's step and their deepest's
    # they take (measure_unalike; None: not measured, priced by the mean)
    unalike: float | None = None
    meta: dict = field(default_factory=dict)   # device, target, proposer, how it was measured

    def __post_init__(self):
        if self.drafted is None:
            self.drafted = [1.0] * len(self.acceptance)

    @property
    def max_k(self) -> int:
        return self.ks[-1]

    def itl(self, batch_size: int) -> list[float]:
        """ITL(batch_size, K) for every K in 0..max_k: over the batch first, then over K."""
        at_batch = [interpolate(self.batch_sizes, [row[j] for row in self.itl_s], batch_size)
                    for j in range(len(self.ks))]
        return [interpolate(self.ks, at_batch, k) for k in range(self.max_k + 1)]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                raw = json.load(f)
            profile = cls(raw["batch_sizes"], raw["ks"], raw["itl_s"], raw["acceptance"], raw.get("drafted"),
                          raw.get("unalike"), raw.get("meta", {}))
        except FileNotFoundError:
            raise NanospecError(f"profile {path} not found; measure one with "
                                "`python -m nanospec.profiler ... --out PROFILE.json`")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise NanospecError(f"{path} is not a dynamic-K profile ({e!r}); measure one with "
                                "`python -m nanospec.profiler`")
        profile.check(path)
        return profile

    def check(self, source: str = "profile") -> None:
        def fail(what):
            raise NanospecError(f"{source}: {what}; measure it again with `python -m nanospec.profiler`")
        sizes = self.batch_sizes
        if not sizes or sizes[0] != 1 or sizes != sorted(set(sizes)):
            fail(f"batch_sizes must ascend from 1, got {self.batch_sizes}")
        if len(self.ks) < 2 or self.ks[0] != 0 or self.ks != sorted(set(self.ks)):
            fail(f"ks must ascend from 0 to at least 1, got {self.ks}")
        if len(self.itl_s) != len(self.batch_sizes) or any(len(row) != len(self.ks) for row in self.itl_s):
            fail("itl_s must be a [batch_sizes][ks] table")
        if not all(t > 0 for row in self.itl_s for t in row):
            fail("every step time in itl_s must be positive")
        if self.unalike is not None and not 0 <= self.unalike <= 1:
            fail(f"unalike must be in [0, 1], got {self.unalike}")
        for name in ("acceptance", "drafted"):
            rates = getattr(self, name)
            if len(rates) < self.max_k or not all(0 <= a <= 1 for a in rates):
                fail(f"{name} must hold {self.max_k} rates in [0, 1]")


def acceptance_length(rates: list[float], k: int) -> float:
    """AL(K) = 1 + sum_{i<K} a_i (see the top of this file)."""
    return 1 + sum(rates[:k])


def itl_at(itl: list[float], drafts: float) -> float:
    """A step's time at `drafts` verified drafts per request (fractional: a mean over the batch),
    itl given at 0, 1, 2, ... drafts: interpolated on that grid (a range: nothing is built, and the
    policy asks a hundred times a step)."""
    return interpolate(range(len(itl)), itl, drafts)


def step_cost(time_at, drafted: list[float], batch: int) -> list[float]:
    """Expected seconds of a step of `batch` requests at K = 0..len(drafted) (expected_time), time_at(x)
    being those of a step whose requests verify x drafts each on average. Asked for K, a request
    verifies D(K) = sum_{i<K} d_i drafts on average: an n-gram proposer finds a match (probability
    d_0) and drafts about D(K) / d_0 tokens, or finds none and drafts nothing."""
    verified = [0.0, *itertools.accumulate(drafted)]   # [K]: D(K)
    return [expected_time(time_at, verified[k], drafted[0], batch, k) for k in range(len(verified))]


def expected_time(time_at, drafts: float, finding: float, batch: int, most: float,
                  exact_up_to: int = 8) -> float:
    """E[time_at(x)] for a step of `batch` requests that verify `drafts` each on average, each finding
    drafts with probability q = `finding` (at least drafts / most: no request drafts more than
    `most`), then drafts / q of them, or none: x = n drafts / (q batch), n ~ Binomial(batch, q).
    Not time_at(drafts): at batch 1 a step verifies 0 drafts or about K, and the step time is not a
    line there: the first draft costs the most, so time_at(D(K)) undercharges a middle K against a
    large one. Past exact_up_to requests x is close to its mean, and time_at(drafts) does (the sum
    over batch + 1 terms would cost host time for nothing). Measurements: docs/dynamic_k.md."""
    if batch > exact_up_to or drafts <= 0:
        return time_at(drafts)
    q = min(1.0, max(finding, drafts / most))
    if q >= 1.0:
        return time_at(drafts)
    return sum(math.comb(batch, n) * q ** n * (1 - q) ** (batch - n) * time_at(n * drafts / (q * batch))
               for n in range(batch + 1))


def allocate(rates: list[list[float]], drafted: list[float], cost_at) -> list[int]:
    """K per request: the argmax over (K_0, .., K_B-1) of (B + sum_b sum_{i<K_b} rates[b][i]) /
    cost_at(x, max_b K_b), x = sum_b sum_{i<K_b} drafted[i] / B the drafts a request verifies on
    average. Every rates[b] must not increase with i. For a given number of drafts in all, the gain
    is largest when they are the most likely accepted ones, and taking them in that order never
    takes a request's draft i + 1 before its draft i; so walking the drafts from the most to the
    least likely accepted and keeping the best prefix finds the argmax (exactly when the cost
    depends on x alone and every draft is found, drafted = 1; with n-gram misses the order ignores
    that a missed draft costs nothing)."""
    batch = len(rates)
    order = sorted((-a, i, b) for b, row in enumerate(rates) for i, a in enumerate(row))
    gain, drafts, deepest = float(batch), 0.0, 0
    best, best_n = gain / cost_at(0.0, 0), 0
    for n, (minus_a, i, b) in enumerate(order, 1):
        gain, drafts, deepest = gain - minus_a, drafts + drafted[i], max(deepest, i + 1)
        goodput = gain / cost_at(drafts / batch, deepest)
        if goodput > best:   # a tie keeps the shorter prefix: same goodput, less work
            best, best_n = goodput, n
    ks = [0] * batch
    for _, _, b in order[:best_n]:
        ks[b] += 1
    return ks


def scaled_rates(rates: list[float], record: list[float], prior_weight: float = 8.0) -> list[float]:
    """One request's a_i: the shared rates times (accepted + m) / (expected + m), record = [drafts
    the request had accepted, drafts the shared rates expected of it] (decayed), capped at 1 and made
    non-increasing in i (a_i is the probability of a run of at least i + 1 accepted). The prior is
    heavy on purpose: n-gram acceptance comes in bursts, and a request judged on its last step or
    two falls to K = 0 after one miss (docs/dynamic_k.md)."""
    accepted, expected = record
    scale = (accepted + prior_weight) / (expected + prior_weight)
    return list(itertools.accumulate((min(1.0, a * scale) for a in rates), min))


def best_k(rates: list[float], cost: list[float]) -> int:
    """argmax over K = 0..len(cost) - 1 of AL(K) / cost[K]; a tie goes to the smaller K (same
    goodput, less work)."""
    goodput = [acceptance_length(rates, k) / t for k, t in enumerate(cost)]
    return max(range(len(cost)), key=lambda k: (goodput[k], -k))


class DynamicK(KPolicy):
    """The policy (a KPolicy): K for the step's requests by goodput; observe(...) after each step.

    For its first warmup_steps decode steps the policy goes by the profile alone, observing all the
    while; then by the online rates and step times. Without the warm-up, one unusual first step sets
    the course: n-gram's drafts on a request's first step are chat-template tokens (for SmolLM2's
    template, the assistant header `<|im_start|>assistant` once more), all rejected, and the rates
    they left made the policy decode at K = 0 until its first probe (logged on SmolLM2 at batch 4:
    K = 4, then six steps of K = 0, while this workload's best K was 3-6). After four steps the
    estimates rest on the steps the profile chose, the unusual one among them."""

    def __init__(self, profile: Profile, max_k: int | None = None, probe_every: int = 8,
                 per_request: bool = False,
                 request_decay: float = 0.95, warmup_steps: int = 4, spans: bool = False, buckets=None,
                 padded: bool = False, rounds: bool = False, confident: bool = False, **rate_options):
        """buckets: the batch sizes the engine pads a step to (cuda_graph.batch_buckets; None: none):
        a step costs what its bucket's step costs, so its time is looked up, and learned, there.
        padded: a verify step gives every row the step's largest K + 1 queries (graphs, pad_batches);
        rounds: the proposer drafts in rounds of model steps (profile_time); confident: its drafts come
        with its confidence in each (Proposer.confident), which the budget (per_request only) verifies by
        (trim)."""
        self.profile, self.per_request, self.request_decay = profile, per_request, request_decay
        self.buckets, self.padded, self.rounds = buckets, padded, rounds
        self.max_k = min(profile.max_k, max_k or profile.max_k)
        rates = SpanRates if spans else AcceptanceRates   # spans: for n-gram (Proposer.acceptance_in_spans)
        self.acceptance = rates(profile.acceptance[:self.max_k], profile.drafted[:self.max_k], **rate_options)
        self.step_times = StepTimes(rate_options.get("decay", 0.97))
        self._itl: dict[int, list[float]] = {}   # batch size -> ITL for K = 0..max_k (the profile is fixed)
        self.probe_every, self.steps, self.warmup_steps = probe_every, 0, warmup_steps
        # the probes' schedule (probed): the next probe's step, the gap after it, how many so far,
        # the K* the last one probed around, and the step of the latest probe
        self.next_probe, self.probe_gap, self.probes = probe_every, probe_every, 0
        self.probed_around, self.last_probe = None, 0
        self.records: dict[int, list[float]] = {}   # id(request) -> its record (choose_per_request)
        self.confident = confident and per_request
        self.calibration = Calibration(self.max_k, self.step_times.decay)   # the drafter's confidence
        self.verifying: list[list[float]] | None = None   # the confidence of the nodes trim kept
        self.kept: dict[int, int] = {}   # id(request) -> the nodes trim kept for it last

    @classmethod
    def for_proposer(cls, profile: Profile, max_k: int, proposer, padded: bool, max_batch: int,
                     per_request: bool = False) -> "DynamicK":
        """The policy for an engine of at most max_batch requests drafting with `proposer` (its
        acceptance by spans of text for n-gram and suffix chains, its rounds for a model drafter),
        whose steps are padded (graphs, pad_batches) or not."""
        return cls(profile, max_k, per_request=per_request, spans=proposer.acceptance_in_spans,
                   buckets=step_buckets(max_batch, padded), padded=padded, rounds=not proposer.drafts_on_host,
                   confident=proposer.confident)

    def rates(self) -> tuple[list[float], list[float]]:
        """(a_i, d_i) the policy goes by: the profile's while it warms up, then the online estimates."""
        if self.steps < self.warmup_steps:
            return self.acceptance.prior, self.acceptance.prior_drafted
        return self.acceptance.rates(), self.acceptance.drafted()

    def bucket(self, batch_size: int) -> int:
        """The batch size a step of batch_size requests runs at: its bucket."""
        if not self.buckets or batch_size > self.buckets[-1]:
            return batch_size
        return self.buckets[bisect.bisect_left(self.buckets, batch_size)]

    def itl(self, batch_size: int) -> list[float]:
        """The profile's ITL(batch_size, K), K = 0..max_k, at the batch's bucket."""
        batch_size = self.bucket(batch_size)
        if batch_size not in self._itl:   # the profile is fixed: interpolate over the batch once
            self._itl[batch_size] = self.profile.itl(batch_size)[:self.max_k + 1]
        return self._itl[batch_size]

    def profile_time(self, batch_size: int, drafts: float, deepest: float | None = None) -> float:
        """The profile's seconds for a step whose requests verify `drafts` each on average, the most
        `deepest` (None: all alike). The profile times requests that verify alike; where they do not,
        the mean undercharges: a padded step gives every row deepest + 1 queries, a CPU's attention
        pads every row's queries to the deepest's (a share of the way from the mean's step to the
        deepest's, measured: Profile.unalike), and a model proposer's round runs deepest draft steps
        however few rows draft, at least a round at batch 1 on top of a plain step."""
        itl = self.itl(batch_size)
        if deepest is None or deepest <= drafts:
            return itl_at(itl, drafts)
        mean, deep = itl_at(itl, drafts), itl_at(itl, deepest)
        share = 1.0 if self.padded else self.profile.unalike or 0.0
        if not self.rounds:
            return mean + share * (deep - mean)
        alone = self.itl(1)
        return max(mean + share * (deep - mean), itl[0] + itl_at(alone, deepest) - alone[0])

    def step_time(self, batch_size: int, drafts: float, deepest: float | None = None) -> float:
        """The seconds the policy expects of such a step: the profile's, times how much slower or
        faster the engine's own steps have run than the profile said (StepTimes; 1 while warming up)."""
        warming = self.steps < self.warmup_steps
        ratio = 1.0 if warming else self.step_times.ratio(self.bucket(batch_size), drafts)
        return self.profile_time(batch_size, drafts, deepest) * ratio

    def cost(self, batch_size: int) -> list[float]:
        """Expected seconds of a step at K = 0..max_k (step_cost)."""
        return step_cost(functools.partial(self.step_time, batch_size), self.rates()[1], batch_size)

    def choose(self, requests, queue_size: int = 0) -> list[int]:
        """K per request: with per_request, each its own (choose_per_request); else the batch's K*."""
        if self.per_request:
            return self.choose_per_request(requests)
        return [self.best_for(max(1, len(requests)))] * len(requests)

    def choose_per_request(self, requests) -> list[int]:
        """K for each request (see allocate; the policy keeps each one's record), with the probes of
        best_for: on a probe step each request one K up, then one K down. A confident drafter is
        asked for twice the nodes trim kept for a request last, and one more (max_k at first; its cap:
        Engine.num_drafts), and trim chooses among its drafts, with the probes: a request whose drafts
        stop paying costs the drafter little host time, one whose drafts pay climbs back in a few
        steps."""
        if self.confident:
            return [min(self.max_k, 2 * self.kept.get(id(r), self.max_k) + 1) for r in requests]
        batch = max(1, len(requests))
        rates, drafted = self.rates()
        ks = allocate([scaled_rates(rates, self.record(r)) for r in requests], drafted,
                      lambda x, deepest: expected_time(lambda y: self.step_time(batch, y, deepest), x,
                                                       drafted[0], batch, self.max_k))
        return [self.probed(k) for k in ks]

    def trim(self, requests, ks, proposal):
        """With a confident drafter: the drafts worth verifying, chosen as allocate chooses K's, over
        each node's calibrated confidence (Calibration) and the step time of the drafts kept, with
        the probes of best_for (a probe step keeps each request one node more, then one fewer). A
        request's K is then the nodes kept for it (its drafts found may be fewer)."""
        self.verifying = None
        if not (self.confident and proposal.confidence):
            return ks, proposal
        batch, rates = len(requests), [self.calibration.rates(row) for row in proposal.confidence]
        counts = allocate(rates, [1.0] * max(map(len, rates)),
                          lambda x, deepest: self.step_time(batch, x, deepest))
        counts = [min(k, self.probed(n)) for k, n in zip(ks, counts)]
        # (a request that found no draft keeps its ask: a copy that starts is drafted in full)
        self.kept.update((id(r), n) for r, n, row in zip(requests, counts, proposal.confidence) if row)
        trimmed = proposal.keep(counts)
        self.verifying = trimmed.confidence
        return counts, trimmed

    def record(self, request) -> list[float]:
        """[drafts the request had accepted, drafts the shared rates expected of it], both decayed."""
        return self.records.setdefault(id(request), [0.0, 0.0])

    def forget(self, request) -> None:
        self.records.pop(id(request), None)
        self.kept.pop(id(request), None)

    def best_for(self, batch_size: int) -> int:
        """K* for a step of batch_size requests; on a probe step (probed) a neighbour, K* + 1 and
        K* - 1 in turn. Only what is tried gets observed: without probes upward, a workload that
        accepts far more than the profile's prompts would stay at the K (or the K = 0) the profile
        suggests; without probes downward, a K that really costs more than the profile says, next
        to a cheaper one, would never show it. The policy climbs one K at a time where that pays,
        at the cost of one slightly worse step per probe."""
        return self.probed(best_k(self.rates()[0], self.cost(batch_size)))

    def probed(self, k: int) -> int:
        """k, or on a probe step its neighbour: k + 1 and k - 1 in turn (k + 1 from 0). Probes come
        every probe_every decode steps at first; while K* stays where the last probe found it the gap
        doubles, up to 8 probe_every; when K* moves it is probe_every again. (A probe of a K that
        keeps losing costs each time: at batch 32, where plain decoding is best on a CPU and K = 1
        runs at 0.89 of its tokens/s, a probe every 8 steps cost about 1.4%.) With per_request it is
        called once per request of a step; the schedule moves on the step's first call."""
        step = self.steps + 1   # the number of the decode step this choice is for
        if self.probed_around is not None and k != self.probed_around:   # K* moved: probe soon
            self.next_probe = min(self.next_probe, max(step, self.last_probe + self.probe_every))
        if not self.probe_every or step not in (self.next_probe, self.last_probe):
            return k
        if step != self.last_probe:
            self.probe_gap = min(2 * self.probe_gap, 8 * self.probe_every) if k == self.probed_around \
                else self.probe_every
            self.next_probe, self.probes, self.probed_around, self.last_probe = step + self.probe_gap, \
                self.probes + 1, k, step
        up = self.probes % 2 == 1 or k == 0
        return min(k + 1, self.max_k) if up else k - 1

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                seconds: float | None = None, requests=None, paths=None) -> None:
        """A decode step: request b asked for ks[b] drafts, found num_draft[b], had num_accepted[b]
        accepted (a tree's: the nodes paths[b]); the step took `seconds` (None: not timed). With
        per_request, `requests` are the step's requests, whose records this updates."""
        self.steps += 1
        if self.verifying is not None:   # a budget over a confident drafter's nodes goes by its calibration
            self.calibration.observe(self.verifying, num_draft or ks, accepted_positions(num_accepted, paths))
        elif not self.confident:
            self.learn_rates(ks, num_accepted, num_draft, requests, paths)
        if seconds is not None:
            batch, verified = len(ks), num_draft or ks
            drafts = sum(verified) / batch
            # against the time the choice priced: per request, its deepest too; one K, the mean
            deepest = max(verified) if self.per_request else None
            self.step_times.observe(self.bucket(batch), drafts,
                                    seconds / self.profile_time(batch, drafts, deepest))

    def learn_rates(self, ks, num_accepted, num_draft, requests, paths) -> None:
        """The shared rates and, with per_request, each request's record (observe's arguments)."""
        if self.per_request and requests:
            rates = self.rates()[0]   # what the shared rates expected, before this step moves them
            for req, k, accepted in zip(requests, ks, num_accepted):
                if k:
                    record = self.record(req)
                    record[0] = record[0] * self.request_decay + accepted
                    record[1] = record[1] * self.request_decay + sum(rates[:k])
        self.acceptance.observe(ks, num_accepted, num_draft, requests, paths)


# ---- the profiler: ITL(batch, K) and acceptance per draft position, measured with the real engine --------
# Every measurement runs on engines built for it (twins of the given engine: the same weights and
# proposer, a KV pool sized for the measurement, their own scheduler, statistics and K policy), so the
# engine that serves requests is never touched. A profile's step times are taken with every request
# verifying exactly the K drafts it asked for (ExactlyK), the K's taking turns a step at a time so that a
# shared machine's drift and the contexts' growth hit every K alike.
MIN_STEPS = 3            # a point's median is over at least this many steps after the warm-up
QUICK_SECONDS = 6.0      # the quick profile's rounds of one batch size stop past this (but MIN_STEPS)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(device, work):
    """(what work() returns, its seconds), the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    result = work()
    sync(device)
    return result, time.perf_counter() - start


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def twin(engine: Engine, num_kv_blocks: int | None = None, max_num_seqs: int | None = None,
         k_policy: KPolicy | None = None, proposer=None, use_graphs: bool | None = None) -> Engine:
    """Another engine over the same model, tokenizer and sampler, with a KV cache of its own
    (num_kv_blocks; default as many as engine's), its own scheduler (max_num_seqs; default
    engine's), statistics and K policy (default: static K = 0), and the proposer's weights with
    state of its own (or `proposer`), CUDA graphs (or `use_graphs`) and step options as engine's:
    the profiler's measurements and the benchmark's rows run on twins."""
    cache, scheduler = engine.kv_cache, engine.scheduler
    num_blocks = num_kv_blocks or cache.allocator.num_blocks
    proposer = proposer or (engine.proposer and engine.proposer.twin(num_blocks))
    other = Engine(engine.model, engine.tokenizer, engine.device, engine.max_model_len, num_blocks,
                   cache.block_size, max_num_seqs or scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                   False, proposer, k_policy, engine.use_graphs if use_graphs is None else use_graphs,
                   cache.allocator.prefix_caching, step_options=engine.step_options)
    other.sampler = other.step_graphs.sampler = engine.sampler   # compiled once (on CUDA), shared
    return other


def greedy_requests(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> list:
    """Greedy requests of exactly max_new_tokens each (EOS ignored), queued on the engine."""
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    reqs = [engine.new_request(i, "", ids, params) for i, ids in enumerate(prompt_ids)]
    engine.add_requests(reqs)
    return reqs


def past_prefill(engine: Engine) -> None:
    """Step until no request is waiting or still in prefill."""
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()


def step_memory(engine: Engine, k: int) -> int:
    """Bytes the largest decode step takes beyond what exists: the largest graphed bucket at K = k,
    sampling with truncation (and draft probabilities, for a model proposer), run once eagerly on
    padding rows (the null and sink blocks only: a one-block engine will do). The CUDA graphs' shared pool
    holds about this much (captured largest first, the smaller graphs reuse it), so the KV cache
    is sized after it. 0 off CUDA, where no graph is kept (the step still runs, so CPU tests run it)."""
    steps, cuda = engine.step_graphs, engine.device.type == "cuda"
    bucket = max(b for b in steps.buckets if b <= MAX_GRAPH_BATCH)
    probs = k > 0 and steps.draft_tables is not None
    sync(engine.device)
    if cuda:
        base = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    steps.grow(k, probs=probs)
    steps.upload_padding(bucket, k)
    with torch.inference_mode():
        steps.verify_body(GraphKey("verify", bucket, k, True, probs), steps.tables.width)
    sync(engine.device)
    return torch.cuda.max_memory_allocated(engine.device) - base if cuda else 0


def fit(engine: Engine, prompt_ids: list[list[int]], tokens: int, what: str) -> list[list[int]]:
    """The prompts, each cut to its last tokens, so that a measurement's requests, with `tokens` more
    each, fit the positions they may reach: the engine's context, and the model's position tables
    (sized to the serving engine's KV pool, which a measuring twin's own pool may exceed)."""
    room = min(engine.max_model_len, engine.model.config.max_position_embeddings) - tokens - 1
    if room < 1:
        raise NanospecError(f"the context ({room + 1} positions short of what it takes to {what} for a "
                            "dynamic-K profile) is too small: give a measured profile, or a larger KV cache "
                            "or max_model_len")
    return [ids[-room:] for ids in prompt_ids]


class ExactlyK:
    """A proposer whose every request verifies exactly the K drafts it asked for. An n-gram proposer
    that finds no match drafts fewer (or none), and the step then costs what a smaller K costs;
    timed that way, a large K looks free and the policy picks it even where verifying K drafts is
    slow. Missing drafts are padded with token 0 (they are rejected; the requests are dropped after
    timing anyway)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def __getattr__(self, name):   # everything but propose is the real proposer's
        return getattr(self.proposer, name)

    def propose(self, requests, ks):
        proposal = self.proposer.propose(requests, ks)
        if self.proposer.drafts_on_host:   # the step pads host drafts with 0 to max(ks); a round's
            proposal.num_draft = list(ks)  # rows draft what they can
        return proposal


def time_decode_steps(engine: Engine, prompt_ids: list[list[int]], batch_size: int, ks: list[int],
                      steps: int, policy=StaticK, most_seconds: float | None = None) -> list[float]:
    """For each k in ks, the median seconds of `steps` decode steps of batch_size requests (prompts
    cycled) verifying exactly k drafts each, on an engine of its own; prefilled first and one
    warm-up round (the first step also does the proposer's catch-up); the k's take turns a step at
    a time. most_seconds: fewer steps, but MIN_STEPS, once the rounds have taken that long (a large
    batch at a large K, on a CPU)."""
    budget = sum((steps + 1) * (k + 1) for k in ks) + 1   # no request finishes while we time
    prompts = fit(engine, prompt_ids, budget, "time the steps")
    prompts = [prompts[i % len(prompts)] for i in range(batch_size)]
    blocks = batch_size * -(-(max(map(len, prompts)) + budget) // engine.kv_cache.block_size)
    engines = [twin(engine, blocks, max_num_seqs=batch_size, k_policy=policy(k),
                    proposer=ExactlyK(engine.proposer.twin(blocks))) for k in ks]
    for other in engines:
        greedy_requests(other, prompts, budget)
        past_prefill(other)
    times, start = [[] for _ in ks], time.perf_counter()
    for step in range(steps + 1):
        for other, seconds in zip(engines, times):
            seconds.append(timed(engine.device, other.step)[1])
        if most_seconds is not None and step >= MIN_STEPS and time.perf_counter() - start > most_seconds:
            break
    return [statistics.median(seconds[1:]) for seconds in times]


def measure_acceptance(engine: Engine, prompt_ids: list[list[int]], k: int,
                       max_new_tokens: int) -> tuple[list[float], list[float]]:
    """a_i and d_i, i < k, over the prompts run greedily at K = k, max_num_seqs at a time."""
    prompt_ids = fit(engine, prompt_ids, max_new_tokens, "measure acceptance")
    running = min(len(prompt_ids), engine.scheduler.max_num_seqs)
    blocks = running * -(-(max(map(len, prompt_ids)) + max_new_tokens) // engine.kv_cache.block_size)
    other = twin(engine, blocks, k_policy=StaticK(k))
    greedy_requests(other, prompt_ids, max_new_tokens)
    other.run_to_completion()
    stats = other.stats
    offered = stats.offered_per_position

    def per_offered(counts):
        return [round(counts[i] / offered[i], 4) if i < len(counts) and offered[i] else 0.0 for i in range(k)]
    return per_offered(stats.accepted_per_position), per_offered(stats.drafted_per_position)


def monotone_in_batch(itl: list[list[float]]) -> list[list[float]]:
    """More requests never take less time: the running maximum over the batch, so that timing
    noise (a median of a few steps) cannot make a larger batch look cheaper. Not over K: on a CPU
    verifying more tokens can really be cheaper (a 5-row matmul may beat a 3-row one), and the
    policy should see that."""
    columns = [list(itertools.accumulate(col, max)) for col in zip(*itl)]
    return [list(row) for row in zip(*columns)]


class OneRow(KPolicy):
    """K = k for a step's first request, none for the others: requests that verify unalike."""

    def __init__(self, k: int):
        self.k = k

    def choose(self, requests, queue_size):
        return [self.k] + [0] * (len(requests) - 1)


def measure_unalike(engine: Engine, prompt_ids: list[list[int]], batch_size: int, k: int, steps: int,
                    itl: list[float], ks: list[int]) -> float:
    """Profile.unalike: a step of batch_size requests, one verifying k drafts and the rest none, timed
    as the grid is (itl: the grid's times at this batch size, at ks), placed between the grid's step
    at the same mean (k / batch_size each) and its step at k for every request: 0 at the first, 1 at
    the second (a padded step)."""
    seconds = time_decode_steps(engine, prompt_ids, batch_size, [k], steps, policy=OneRow)[0]
    mean, deep = interpolate(ks, itl, k / batch_size), interpolate(ks, itl, k)
    return round(min(1.0, max(0.0, (seconds - mean) / (deep - mean))), 4) if deep > mean else 1.0


def measure_profile(engine: Engine, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int],
                    steps: int, max_new_tokens: int, meta: dict, log=None,
                    most_seconds: float | None = None) -> Profile:
    """ITL over batch_sizes x ks and acceptance at max(ks), with the engine's model and proposer;
    meta: what was measured (target, proposer, ...), stored in the profile with the device."""
    if engine.proposer is None:
        raise NanospecError("a dynamic-K profile needs a proposer (a draft model, an EAGLE head or n-gram)")
    if max(batch_sizes) > engine.scheduler.max_num_seqs:
        raise NanospecError(f"batch size {max(batch_sizes)} is above max_num_seqs "
                            f"{engine.scheduler.max_num_seqs}")
    start = time.perf_counter()
    measured, spent = [], 0.0
    for i, b in enumerate(batch_sizes):
        measured.append([round(t, 6) for t in time_decode_steps(engine, prompt_ids, b, ks, steps,
                                                                 most_seconds=most_seconds)])
        if log:   # the time left, were every batch size to take as long as the largest so far
            spent, took = time.perf_counter() - start, time.perf_counter() - start - spent
            left = (f", at least {took * (len(batch_sizes) - i - 1):.0f} s left" if i + 1 < len(batch_sizes)
                    else "")
            log(f"profile: batch {b} ({i + 1}/{len(batch_sizes)}, {spent:.0f} s{left}): step ms "
                + " ".join(f"K{k}={1000 * t:.1f}" for k, t in zip(ks, measured[-1])))
    unalike = (measure_unalike(engine, prompt_ids, batch_sizes[-1], ks[-1], steps, measured[-1], ks)
               if batch_sizes[-1] > 1 else None)
    if log and unalike is not None:
        log(f"unalike requests (one of {batch_sizes[-1]} at K{ks[-1]}): {unalike:.2f} of the way to all")
    acceptance, drafted = measure_acceptance(engine, prompt_ids, max(ks), max_new_tokens)
    if log:
        log("acceptance per position: " + " ".join(f"{a:.2f}" for a in acceptance))
        log("drafts found per position: " + " ".join(f"{d:.2f}" for d in drafted))
    meta = {"device": device_name(engine.device), **meta, "num_prompts": len(prompt_ids),
            "steps_per_point": steps, "most_seconds_per_batch_size": most_seconds,
            "acceptance_tokens_per_prompt": max_new_tokens, "itl_s_measured": measured,
            "seconds": round(time.perf_counter() - start, 2)}
    profile = Profile(list(batch_sizes), list(ks), monotone_in_batch(measured), acceptance, drafted, unalike,
                      meta)
    profile.check()
    return profile


def quick_profile(engine: Engine, prompt_ids: list[list[int]], max_k: int, meta: dict, log=None) -> Profile:
    """The built-in profile measured at start-up when none is given: a coarse grid (batch 1, 8, 64,
    ... up to the engine's max_num_seqs; K 0, 1, 2, 3, 4, 6, 8 up to max_k), 9 steps a point (the
    median: a step's time moves on a shared CPU), fewer (but MIN_STEPS) where a batch size's rounds
    pass QUICK_SECONDS, acceptance over 8 prompts x 32 tokens.
    Interpolation fills in the rest; measured step times and online rates correct it while the engine
    runs. On a CPU the grid is coarser, so that it takes under a minute: batch 1, 8 and 32 and K 0, 1,
    2, 4, 8 (past its last batch a profile follows its last segment, and step times are linear enough
    in K)."""
    cuda = engine.device.type == "cuda"
    largest = engine.scheduler.max_num_seqs if cuda else min(engine.scheduler.max_num_seqs, 32)
    batch_sizes = sorted({b for b in (1, 8, 64) if b < largest} | {largest})
    ks = sorted({k for k in ((0, 1, 2, 3, 4, 6, 8) if cuda else (0, 1, 2, 4, 8)) if k < max_k} | {max_k})
    return measure_profile(engine, prompt_ids[:8], batch_sizes, ks, steps=9, max_new_tokens=32, meta=meta,
                           log=log, most_seconds=QUICK_SECONDS)
