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

ITL(B, K) comes from a profile measured on this machine with the real engine, proposer included,
every request verifying exactly K drafts (`python -m nanospec.dynamic_k profile ...`, or a quick one
at start-up), interpolated linearly between the profiled batch sizes and K values (and at the
fractional D(K)). Neither half of goodput is trusted blindly once the engine runs: after a
warm-up of a few decode steps on the profile alone, a_i and d_i follow what the running requests
accept (AcceptanceRates, or SpanRates), and ITL is corrected by how long the engine's own steps take next to what
the profile predicts (StepTimes: the profile's prompts are not the workload's, contexts grow, a
shared machine slows down). Every probe_every-th step tries a neighbour of K* (K* + 1, then
K* - 1), so both corrections also see the K's the policy does not pick.
The choice is a few hundred floating-point operations on the host per step (a few thousand with
spans): no device sync (the step time is read after the step's one device-to-host copy), nothing
per vocabulary.

    python -m nanospec.dynamic_k profile [--target ...] --ngram --out profile.json
"""
from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

from nanospec.errors import NanospecError, run_command


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
    batch_sizes: list[int]          # ascending, from 1
    ks: list[int]                   # ascending, from 0
    itl_s: list[list[float]]        # [batch][k]: seconds per decode step
    acceptance: list[float]         # a_i for i < max(ks), greedy, over the profile's prompts
    meta: dict = field(default_factory=dict)   # device, target, proposer, how it was measured
    drafted: list[float] | None = None         # d_i, the same way (None: the proposer always drafts)

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
            json.dump({"batch_sizes": self.batch_sizes, "ks": self.ks, "itl_s": self.itl_s,
                       "acceptance": self.acceptance, "drafted": self.drafted, "meta": self.meta}, f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                raw = json.load(f)
            profile = cls(raw["batch_sizes"], raw["ks"], raw["itl_s"], raw["acceptance"], raw.get("meta", {}),
                          raw.get("drafted"))
        except FileNotFoundError:
            raise NanospecError(f"profile {path} not found; measure one with "
                                "`python -m nanospec.dynamic_k profile ... --out PROFILE.json`")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise NanospecError(f"{path} is not a dynamic-K profile ({e!r}); measure one with "
                                "`python -m nanospec.dynamic_k profile`")
        profile.check(path)
        return profile

    def check(self, source: str = "profile") -> None:
        def fail(what):
            raise NanospecError(f"{source}: {what}; measure it again with `python -m nanospec.dynamic_k profile`")
        if not self.batch_sizes or self.batch_sizes[0] != 1 or self.batch_sizes != sorted(set(self.batch_sizes)):
            fail(f"batch_sizes must ascend from 1, got {self.batch_sizes}")
        if len(self.ks) < 2 or self.ks[0] != 0 or self.ks != sorted(set(self.ks)):
            fail(f"ks must ascend from 0 to at least 1, got {self.ks}")
        if len(self.itl_s) != len(self.batch_sizes) or any(len(row) != len(self.ks) for row in self.itl_s):
            fail("itl_s must be a [batch_sizes][ks] table")
        if not all(t > 0 for row in self.itl_s for t in row):
            fail("every step time in itl_s must be positive")
        for name in ("acceptance", "drafted"):
            rates = getattr(self, name)
            if len(rates) < self.max_k or not all(0 <= a <= 1 for a in rates):
                fail(f"{name} must hold {self.max_k} rates in [0, 1]")


def acceptance_length(rates: list[float], k: int) -> float:
    """AL(K) = 1 + sum_{i<K} a_i (see the top of this file)."""
    return 1 + sum(rates[:k])


def itl_at(itl: list[float], drafts: float) -> float:
    """A step's time at `drafts` verified drafts per request (fractional: a mean over the batch),
    itl given at 0, 1, 2, ... drafts (interpolate on that grid, without building it: the policy
    asks a hundred times a step)."""
    if len(itl) == 1:
        return itl[0]
    i = min(int(max(drafts, 0.0)), len(itl) - 2)
    y = itl[i] + (itl[i + 1] - itl[i]) * (drafts - i)
    return max(y, itl[-1]) if drafts > len(itl) - 1 else y


def step_cost(time_at, drafted: list[float], batch: int) -> list[float]:
    """Expected seconds of a step of `batch` requests at K = 0..len(drafted) (expected_time), time_at(x)
    being those of a step whose requests verify x drafts each on average. Asked for K, a request
    verifies D(K) = sum_{i<K} d_i drafts on average: an n-gram proposer finds a match (probability
    d_0) and drafts about D(K) / d_0 tokens, or finds none and drafts nothing."""
    verified = [0.0, *itertools.accumulate(drafted)]   # [K]: D(K)
    return [expected_time(time_at, verified[k], drafted[0], batch, k) for k in range(len(verified))]


def expected_time(time_at, drafts: float, finding: float, batch: int, most: float, exact_up_to: int = 8) -> float:
    """E[time_at(x)] for a step of `batch` requests that verify `drafts` each on average, each finding
    drafts with probability q = `finding` (at least drafts / most: no request drafts more than
    `most`), then drafts / q of them, or none: x = n drafts / (q batch), n ~ Binomial(batch, q).
    Not time_at(drafts): at batch 1 a step verifies 0 drafts or about K, and the step time is not a
    line there: the first draft costs the most (SmolLM2 on this CPU,
    dynamic_k_cpu_profile_b1_4_16.json: 11.6 ms, then 5.0 ms a draft), so
    time_at(D(K)) undercharges a middle K against a large one (replayed on SmolLM2's n-gram steps at
    batch 1, the policy went from 0.954 and 0.961 of the best static K to 0.990 and 0.971, on two
    profiles). Past exact_up_to requests x is close to its mean: time_at(drafts) (replayed at batch
    16, the policy chose as well either way, and the sum over batch + 1 terms took half its host time)."""
    if batch > exact_up_to or drafts <= 0:
        return time_at(drafts)
    q = min(1.0, max(finding, drafts / most))
    if q >= 1.0:
        return time_at(drafts)
    return sum(math.comb(batch, n) * q ** n * (1 - q) ** (batch - n) * time_at(n * drafts / (q * batch))
               for n in range(batch + 1))


def allocate(rates: list[list[float]], drafted: list[float], cost_at) -> list[int]:
    """K per request: the argmax over (K_0, .., K_B-1) of (B + sum_b sum_{i<K_b} rates[b][i]) /
    cost_at(x), x = sum_b sum_{i<K_b} drafted[i] / B the drafts a request verifies on average.
    Every rates[b] must not increase with i. For a given number of drafts in all, the gain is largest
    when they are the most likely accepted ones, and taking them in that order never takes a
    request's draft i + 1 before its draft i; so walking the drafts from the most to the least likely
    accepted and keeping the best prefix finds the argmax (exactly when every draft is found,
    drafted = 1; with n-gram misses the order ignores that a missed draft costs nothing)."""
    batch = len(rates)
    order = sorted((-a, i, b) for b, row in enumerate(rates) for i, a in enumerate(row))
    gain, drafts = float(batch), 0.0
    best, best_n = gain / cost_at(0.0), 0
    for n, (minus_a, i, b) in enumerate(order, 1):
        gain, drafts = gain - minus_a, drafts + drafted[i]
        goodput = gain / cost_at(drafts / batch)
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
    two falls to K = 0 after one miss (replayed on logged SmolLM2 steps, prior 2 lost 10-20% to one K
    for the batch, prior 8 gained 1-7%)."""
    accepted, expected = record
    scale = (accepted + prior_weight) / (expected + prior_weight)
    return list(itertools.accumulate((min(1.0, a * scale) for a in rates), min))


def best_k(rates: list[float], cost: list[float]) -> int:
    """argmax over K = 0..len(cost) - 1 of AL(K) / cost[K]; a tie goes to the smaller K (same
    goodput, less work)."""
    goodput = [acceptance_length(rates, k) / t for k, t in enumerate(cost)]
    return max(range(len(cost)), key=lambda k: (goodput[k], -k))


class AcceptanceRates:
    """a_i (draft i accepted) and d_i (draft i found) of the running requests, per request-step that
    offered draft i (asked the proposer for more than i drafts, whether or not it found them: an
    n-gram miss counts as a rejection, so AL(K) is what a request really gains per step).

    Counts decay by `decay` every step, so a change of workload shows within about 1 / (1 - decay)
    steps. Each rate blends what was observed with a prior worth `prior_weight` request-steps:
    (count_i + m x_i) / (offered_i + m). x_0 is the profile's rate; x_i, i > 0, is the profile's
    conditional rate prior_i / prior_{i-1} times the estimate at i - 1, so a position rarely offered
    follows the profile's shape from the level observed before it. After a long stretch of K = 0
    every count has decayed away and the profile's rates are back. (The policy's warm-up, in
    DynamicK, is counted in decode steps, whatever their K: a gate counted in steps with drafts
    would hold the profile's rates for as long as the policy, trusting them, picks K = 0.)"""

    def __init__(self, prior: list[float], prior_drafted: list[float] | None = None, decay: float = 0.97,
                 prior_weight: float = 4.0):
        self.prior, self.decay, self.prior_weight = list(prior), decay, prior_weight
        self.prior_drafted = list(prior_drafted) if prior_drafted is not None else [1.0] * len(prior)
        self.offered = [0.0] * len(prior)
        self.found = [0.0] * len(prior)
        self.accepted = [0.0] * len(prior)

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                requests=None) -> None:
        """One decode step: request b asked for ks[b] drafts, got num_draft[b] (default ks[b]) and
        had num_accepted[b] accepted (whose request it was does not matter here; it does to SpanRates)."""
        n = len(self.prior)
        for counts, per_request in ((self.offered, ks), (self.found, num_draft or ks), (self.accepted, num_accepted)):
            counts[:] = [c * self.decay for c in counts]
            for m in per_request:
                for i in range(min(m, n)):
                    counts[i] += 1

    def rates(self) -> list[float]:
        return self._estimate(self.accepted, self.prior)

    def drafted(self) -> list[float]:
        return self._estimate(self.found, self.prior_drafted)

    def _estimate(self, counts: list[float], prior: list[float]) -> list[float]:
        rates, m = [], self.prior_weight
        for i, p in enumerate(prior):
            if i == 0:
                x = p
            else:
                x = rates[-1] * min(p / prior[i - 1], 1.0) if prior[i - 1] > 0 else 0.0
            rates.append((counts[i] + m * x) / (self.offered[i] + m))
        return rates


class SpanRates:
    """a_i and d_i for a proposer that drafts the text ahead (n-gram), from the spans it gets right.

    Per-step rates measured at one K misjudge another: a request that copies its prompt for 20
    tokens spends 10 steps doing it at K = 1 and 3 at K = 6, so the larger K is, the fewer of its
    steps fall in a copy and the lower every measured a_i (replayed on SmolLM2 at batch 16: a_0 is
    0.60 at K = 1 and 0.40 at K = 6). Judged on the rates of the K it runs, every K looks best to
    itself; the policy settled one K above the best static K (4 where 3 was best, goodput -3%).

    What does not depend on K is the text: where the proposer starts to be right, and for how many
    tokens (a span of L, then a token it gets wrong). A step that accepts all k drafts goes on with
    the span; one that accepts fewer, or finds fewer than asked, ends it at what it accepted; a
    step without drafts, or a request that leaves the batch, ends it where it is. At K a span of L
    takes L // (K + 1) + 1 steps for its L + 1 tokens (the +1 is the target's own, which ends it), so

        AL(K) = E[L + 1] / E[L // (K + 1) + 1]

    (for a geometric L, P(L >= j) = p^j, that is 1 + p + .. + p^K, the usual formula) and
    a_i = AL(i + 1) - AL(i). D(K) likewise: the full steps verify K drafts, the last one r = L mod
    (K + 1) accepted ones plus whatever the proposer found past them (e_i, counted on the steps that
    ended a span), and d_i = D(i + 1) - D(i). Not for a draft model or EAGLE: their draft i is worse
    the deeper i lies within a step (they build on their own unverified tokens), which per-position
    rates (AcceptanceRates) capture and spans do not.

    A step that accepts all k drafts cannot tell whether the target's own token after them was the
    proposer's next draft too; spans count it in (n-gram's match usually goes on), which overstates
    the spans that end exactly there: on text, AL(K) comes out 1-2% high (tests/test_replay.py). The
    spans (capped at 16 (K_max + 1): longer ones count as that) decay by `decay` per step; the rates
    blend with the profile's by prior_weight spans."""

    def __init__(self, prior: list[float], prior_drafted: list[float] | None = None, decay: float = 0.99,
                 prior_weight: float = 4.0):
        self.prior, self.decay, self.prior_weight = list(prior), decay, prior_weight
        self.prior_drafted = list(prior_drafted) if prior_drafted is not None else [1.0] * len(prior)
        self.spans = [0.0] * (16 * (len(prior) + 1) + 1)   # [L]: decayed count of spans of L tokens
        self.open: dict[int, tuple[object, int]] = {}       # id(request) -> (request, tokens of its open span)
        self.past_accepted = [0.0] * len(prior)             # [i]: span-ending steps that offered draft i past the accepted
        self.past_found = [0.0] * len(prior)                # ... and found it
        self.estimates = None                               # (a_i, d_i), worked out once a step

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                requests=None) -> None:
        """One decode step (as AcceptanceRates.observe); `requests` tell whose spans go on (default:
        the batch's slots, for a batch whose requests stay put)."""
        requests = requests if requests is not None else range(len(ks))
        self.estimates = None
        for counts in (self.spans, self.past_accepted, self.past_found):
            counts[:] = [c * self.decay for c in counts]
        here = {id(r) for r in requests}
        for key in [key for key in self.open if key not in here]:   # finished or preempted: its span ends where it is
            self.end_span(self.open.pop(key)[1] - 1)
        for req, k, accepted, found in zip(requests, ks, num_accepted, num_draft or ks):
            _, span = self.open.pop(id(req), (req, 0))
            if k == 0:   # says nothing of the text; an open span ends where it is
                self.end_span(span - 1)
            elif accepted == k == found:
                self.open[id(req)] = req, span + k + 1
            else:
                self.end_span(span + accepted)
                for i in range(accepted, k):
                    self.past_accepted[i] += 1
                    self.past_found[i] += i < found

    def end_span(self, length: int) -> None:
        """Count a span of `length` tokens. An open span of n tokens that ends where it is (no next
        step tells how it went on) counts as n - 1 and its last token (the target's own): its steps
        and tokens stay those it really took; -1 is no span at all."""
        if length >= 0:
            self.spans[min(length, len(self.spans) - 1)] += 1

    def seen(self) -> list[tuple[int, float]]:
        """(L, decayed count) for the span lengths seen, the rest left out (most are never seen). An
        open span of n tokens counts too, as one of n - 1 (as if it ended where it is), until it
        ends: at batch 1 a copy in progress is most of what the policy should go by (counting ended
        spans only, it kept K = 2 through the 12 steps of a 36-token copy, logged on SmolLM2)."""
        counts = {length: n for length, n in enumerate(self.spans) if n > 1e-9}
        for _, tokens in self.open.values():
            length = min(tokens - 1, len(self.spans) - 1)
            counts[length] = counts.get(length, 0.0) + 1.0
        return sorted(counts.items())

    def acceptance_length(self, k: int, seen=None) -> float:
        seen = seen or self.seen()
        return sum(n * (length + 1) for length, n in seen) / sum(n * (length // (k + 1) + 1) for length, n in seen)

    def drafts(self, k: int, seen=None) -> float:
        """D(k): drafts a request verifies per step at K = k."""
        m = self.prior_weight
        found_past = [(f + m * d) / (a + m) for f, a, d in zip(self.past_found, self.past_accepted, self.prior_drafted)]
        found_before = [0.0, *itertools.accumulate(found_past)]   # [i]: sum of found_past[:i]
        drafts = steps = 0.0
        for length, n in seen or self.seen():
            full, last = divmod(length, k + 1)
            drafts += n * (k * full + last + found_before[k] - found_before[last])
            steps += n * (full + 1)
        return drafts / steps

    def rates(self) -> list[float]:
        """a_i = AL(i + 1) - AL(i), non-increasing (a run of i + 2 accepted is no likelier than i + 1)."""
        return self.estimate()[0]

    def drafted(self) -> list[float]:
        """d_i = D(i + 1) - D(i)."""
        return self.estimate()[1]

    def estimate(self) -> tuple[list[float], list[float]]:
        if self.estimates is None:
            ks, seen = range(len(self.prior) + 1), self.seen()
            if seen:   # else nothing seen, or all of it decayed away (a long stretch of K = 0)
                als, ds = [self.acceptance_length(k, seen) for k in ks], [self.drafts(k, seen) for k in ks]
                rates, drafted = [b - a for a, b in itertools.pairwise(als)], [b - a for a, b in itertools.pairwise(ds)]
            else:
                rates, drafted = self.prior, self.prior_drafted
            self.estimates = (list(itertools.accumulate(self.blend(rates, self.prior), min)),
                              self.blend(drafted, self.prior_drafted))
        return self.estimates

    def weight(self) -> float:
        return sum(self.spans) + len(self.open)   # what seen() counts, the open spans with it

    def blend(self, observed: list[float], prior: list[float]) -> list[float]:
        w, m = self.weight(), self.prior_weight
        return [(w * x + m * p) / (w + m) for x, p in zip(observed, prior)]


class StepTimes:
    """How long the engine's decode steps really take, as a ratio to what the profile predicts for
    them, modelled per batch size as a line in x, the drafts a request verified in the step:
    ratio(x). Fitted by least squares over the steps seen at that batch size (each weighted by
    decay^age, so the fit follows a change within about 1 / (1 - decay) steps); the line's level
    is shrunk toward the mean ratio over every step and its slope toward 0, by `prior_weight`
    pseudo-steps each.

    Why a line and not a ratio per K: a step's time moves +-20% on a shared CPU, so a K seen only in
    a few probe steps would be judged on noise; the line pools every step's evidence (n-gram steps
    verify anything from 0 to K drafts, probes add K* +- 1) into two numbers. The mean over every
    step is what a batch size not seen yet gets (the machine is 30% slower today: every batch is)."""

    def __init__(self, decay: float = 0.97, prior_weight: float = 2.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.now = 0                                    # steps observed
        self.overall = (0.0, 1.0, 0)                    # (weight, mean ratio, step of the last update)
        self.sums: dict[int, tuple[list[float], int]] = {}   # batch -> ([w, wx, wxx, wr, wxr], step of the last update)
        self.lines: dict[int, tuple[float, float, float] | None] = {}   # batch -> the line fitted this step

    def observe(self, batch_size: int, drafts: float, ratio: float) -> None:
        self.now += 1
        self.lines.clear()
        weight, mean, at = self.overall
        weight = weight * self.decay ** (self.now - at) + 1
        self.overall = weight, mean + (ratio - mean) / weight, self.now
        sums = self._decayed(batch_size)
        for i, term in enumerate((1.0, drafts, drafts * drafts, ratio, drafts * ratio)):
            sums[i] += term
        self.sums[batch_size] = sums, self.now

    def ratio(self, batch_size: int, drafts: float) -> float:
        """The fitted line at `drafts`: through the weighted mean (x_mean, r_mean) of the batch's steps,
        r_mean shrunk toward the mean over every step, the slope toward 0 (both by prior_weight)."""
        if batch_size not in self.lines:   # fitted once a step: the policy asks for many x
            self.lines[batch_size] = self.fit(batch_size)
        if self.lines[batch_size] is None:
            return self.overall[1]
        x_mean, r_mean, slope = self.lines[batch_size]
        return max(r_mean + slope * (drafts - x_mean), 0.1)     # a line fitted on few points must not make a step free

    def fit(self, batch_size: int) -> tuple[float, float, float] | None:
        """(x_mean, r_mean, slope) of the batch's line, None where no step of that batch is left."""
        w, wx, wxx, wr, wxr = self._decayed(batch_size)
        m = self.prior_weight
        if w < 1e-9:
            return None
        x_mean = wx / w
        slope = (wxr - wx * wr / w) / (wxx - wx * x_mean + m)   # centred covariance / (variance + m)
        return x_mean, (wr + m * self.overall[1]) / (w + m), slope

    def _decayed(self, batch_size: int) -> list[float]:
        sums, at = self.sums.get(batch_size, ([0.0] * 5, self.now))
        return [v * self.decay ** (self.now - at) for v in sums]


class DynamicK:
    """The policy: choose(batch_size) -> K for this step; observe(...) after it.

    For its first warmup_steps decode steps the policy goes by the profile alone, observing all the
    while; then by the online rates and step times. Without the warm-up, one unusual first step sets
    the course: n-gram's drafts on a request's first step are chat-template tokens (for SmolLM2's
    template, the assistant header `<|im_start|>assistant` once more), all rejected, and the rates
    they left made the policy decode at K = 0 until its first probe (logged on SmolLM2 at batch 4:
    K = 4, then six steps of K = 0, while this workload's best K was 3-6). After four steps the
    estimates rest on the steps the profile chose, the unusual one among them."""

    def __init__(self, profile: Profile, max_k: int | None = None, probe_every: int = 8, per_request: bool = False,
                 request_decay: float = 0.95, warmup_steps: int = 4, spans: bool = False, **rate_options):
        self.profile, self.per_request, self.request_decay = profile, per_request, request_decay
        self.max_k = min(profile.max_k, max_k or profile.max_k)
        rates = SpanRates if spans else AcceptanceRates   # spans: for n-gram (Proposer.acceptance_in_spans)
        self.acceptance = rates(profile.acceptance[:self.max_k], profile.drafted[:self.max_k], **rate_options)
        self.step_times = StepTimes(rate_options.get("decay", 0.97))
        self._itl: dict[int, list[float]] = {}   # batch size -> ITL for K = 0..max_k (the profile is fixed)
        self.probe_every, self.steps, self.warmup_steps = probe_every, 0, warmup_steps

    def rates(self) -> tuple[list[float], list[float]]:
        """(a_i, d_i) the policy goes by: the profile's while it warms up, then the online estimates."""
        if self.steps < self.warmup_steps:
            return self.acceptance.prior, self.acceptance.prior_drafted
        return self.acceptance.rates(), self.acceptance.drafted()

    def time_ratio(self, batch_size: int, drafts: float) -> float:
        """Measured step time over the profile's (StepTimes), 1 while the policy warms up."""
        return 1.0 if self.steps < self.warmup_steps else self.step_times.ratio(batch_size, drafts)

    def itl(self, batch_size: int) -> list[float]:
        if batch_size not in self._itl:
            self._itl[batch_size] = self.profile.itl(batch_size)[:self.max_k + 1]
        return self._itl[batch_size]

    def step_time(self, batch_size: int, drafts: float) -> float:
        """Seconds of a step whose requests verify `drafts` each on average: the profile's ITL there,
        times the measured ratio."""
        return itl_at(self.itl(batch_size), drafts) * self.time_ratio(batch_size, drafts)

    def cost(self, batch_size: int) -> list[float]:
        """Expected seconds of a step at K = 0..max_k (step_cost)."""
        return step_cost(functools.partial(self.step_time, batch_size), self.rates()[1], batch_size)

    def choose_per_request(self, requests) -> list[int]:
        """K for each request (see allocate; each keeps its record in request.dynamic_k_record), with
        the probes of choose: every probe_every-th step each request one K up, then one K down."""
        batch = max(1, len(requests))
        rates, drafted = self.rates()
        time_at = functools.partial(self.step_time, batch)
        ks = allocate([scaled_rates(rates, r.dynamic_k_record) for r in requests], drafted,
                      lambda x: expected_time(time_at, x, drafted[0], batch, self.max_k))
        return [self.probed(k) for k in ks]

    def choose(self, batch_size: int) -> int:
        """K* for this step; every probe_every-th decode step a neighbour, K* + 1 and K* - 1 in turn.
        Only what is tried gets observed: without probes upward, a workload that accepts far more
        than the profile's prompts would stay at the K (or the K = 0) the profile suggests; without
        probes downward, a K that really costs more than the profile says, next to a cheaper one,
        would never show it. The policy climbs one K at a time where that pays, at the cost of one
        slightly worse step in probe_every."""
        return self.probed(best_k(self.rates()[0], self.cost(batch_size)))

    def probed(self, k: int) -> int:
        """k, or on every probe_every-th decode step its neighbour: k + 1 and k - 1 in turn (k + 1 from 0)."""
        probe = self.steps + 1   # the number of the decode step this choice is for
        if not self.probe_every or probe % self.probe_every:
            return k
        up = (probe // self.probe_every) % 2 == 1 or k == 0
        return min(k + 1, self.max_k) if up else k - 1

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                seconds: float | None = None, requests=None) -> None:
        """A decode step: request b asked for ks[b] drafts, found num_draft[b], had num_accepted[b]
        accepted; the step took `seconds` (None: not timed). With per_request, `requests` are the
        step's requests, whose records this updates."""
        self.steps += 1
        if self.per_request and requests:
            rates = self.rates()[0]   # what the shared rates expected, before this step moves them
            for req, k, accepted in zip(requests, ks, num_accepted):
                if k:
                    record = req.dynamic_k_record
                    record[0] = record[0] * self.request_decay + accepted
                    record[1] = record[1] * self.request_decay + sum(rates[:k])
        self.acceptance.observe(ks, num_accepted, num_draft, requests)
        if seconds is not None:
            batch, verified = len(ks), num_draft or ks
            drafts = sum(verified) / batch
            self.step_times.observe(batch, drafts, seconds / itl_at(self.itl(batch), drafts))


# ---- measuring a profile with the real engine ----

def time_decode_steps(engine, prompt_ids: list[list[int]], batch_size: int, ks: list[int], steps: int) -> list[float]:
    """For each k in ks, the median seconds of `steps` decode steps of the same `batch_size` requests
    (prompts cycled) verifying exactly k drafts each (ExactlyK); prefilled once, one warm-up round
    (the first step also does the proposer's catch-up). The k's take turns a step at a time, so
    that a shared machine's drift, and the contexts' growth, hit every k alike (timed k after k,
    four quick profiles put K = 6 7-48% above K = 4 at batch 1 on this CPU, and the policy shunned
    K = 6 where it was the best static K; taking turns, 6-9%)."""
    from nanospec.bench import timed
    from nanospec.engine import SamplingParams
    budget = sum((steps + 1) * (k + 1) for k in ks) + 1   # no request may finish while we time
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    reqs = [engine.new_request(i, "", prompt_ids[i % len(prompt_ids)], params) for i in range(batch_size)]
    scheduler = engine.scheduler
    engine.add_requests(reqs)
    engine.dynamic_k, proposer = None, engine.proposer
    engine.proposer = ExactlyK(proposer)
    try:
        while scheduler.waiting or any(r.in_prefill for r in scheduler.running):
            engine.step()
        times = {k: [] for k in ks}
        for _ in range(steps + 1):
            for k in ks:
                engine.num_speculative_tokens = k
                times[k].append(timed(engine.device, engine.step)[1])
        medians = [statistics.median(times[k][1:]) for k in ks]
    finally:
        engine.proposer = proposer
        for req in list(scheduler.running):   # done measuring: drop them unfinished
            scheduler.finish(req)
    return medians


class ExactlyK:
    """The engine's proposer while a profile is timed: every request verifies exactly the K drafts
    it asked for. An n-gram proposer that finds no match drafts fewer (or none), and the step then
    costs what a smaller K costs; timed that way, a large K looks free and the policy picks it even
    where verifying K drafts is slow. Missing drafts are padded with token 0 (they are rejected, and
    the requests are dropped after timing anyway)."""

    def __init__(self, proposer):
        self.proposer = proposer

    def __getattr__(self, name):   # everything but propose is the real proposer's
        return getattr(self.proposer, name)

    def propose(self, requests, ks, sampling):
        proposal = self.proposer.propose(requests, ks, sampling)
        if proposal.draft_probs is None:   # one-hot drafts: draft_ids is already padded to max(ks)
            proposal.num_draft = list(ks)
        return proposal


def measure_acceptance(llm, prompt_ids: list[list[int]], k: int, max_new_tokens: int) -> tuple[list[float], list[float]]:
    """a_i and d_i, i < k, over the prompts (the bench's greedy run, max_num_seqs at a time)."""
    from nanospec.bench import time_nanospec
    engine = llm.engine
    engine.dynamic_k, engine.num_speculative_tokens = None, k
    time_nanospec(llm, prompt_ids, engine.scheduler.max_num_seqs, max_new_tokens)
    offered = engine.stats.offered_per_position

    def per_offered(counts):
        return [round(counts[i] / offered[i], 4) if i < len(counts) and offered[i] else 0.0 for i in range(k)]
    return per_offered(engine.stats.accepted_per_position), per_offered(engine.stats.drafted_per_position)


def measure_profile(llm, prompt_ids: list[list[int]], batch_sizes: list[int], ks: list[int], steps: int,
                    max_new_tokens: int, log=None) -> Profile:
    """ITL over batch_sizes x ks and acceptance at max(ks), with llm's own engine and proposer."""
    from nanospec.bench import device_name
    from nanospec.engine import Stats
    engine = llm.engine
    if engine.proposer is None:
        raise NanospecError("a dynamic-K profile needs a proposer: add --draft PATH, --eagle PATH or --ngram")
    if max(batch_sizes) > engine.scheduler.max_num_seqs:
        raise NanospecError(f"batch size {max(batch_sizes)} is above max_num_seqs {engine.scheduler.max_num_seqs}")
    saved = engine.dynamic_k, engine.num_speculative_tokens, engine.stats
    engine.stats = Stats()   # the measuring steps count nowhere
    start = time.perf_counter()
    itl = []
    for b in batch_sizes:
        itl.append([round(t, 6) for t in time_decode_steps(engine, prompt_ids, b, ks, steps)])
        if log:
            log(f"batch {b}: step ms " + " ".join(f"K{k}={1000 * t:.1f}" for k, t in zip(ks, itl[-1])))
    measured = itl
    itl = monotone_in_batch(itl)
    acceptance, drafted = measure_acceptance(llm, prompt_ids, max(ks), max_new_tokens)
    if log:
        log("acceptance per position: " + " ".join(f"{a:.2f}" for a in acceptance))
        log("drafts found per position: " + " ".join(f"{d:.2f}" for d in drafted))
    engine.dynamic_k, engine.num_speculative_tokens, engine.stats = saved
    meta = {"device": device_name(llm.device), "dtype": str(llm.dtype), "target": llm.target_name,
            "proposer": llm.proposer_name, "num_prompts": len(prompt_ids), "steps_per_point": steps,
            "acceptance_tokens_per_prompt": max_new_tokens, "itl_s_measured": measured,
            "seconds": round(time.perf_counter() - start, 2)}
    profile = Profile(list(batch_sizes), list(ks), itl, acceptance, meta, drafted)
    profile.check()
    return profile


def monotone_in_batch(itl: list[list[float]]) -> list[list[float]]:
    """More requests never take less time: the running maximum over the batch, so that timing
    noise (a median of a few steps) cannot make a larger batch look cheaper. Not over K: on a CPU
    verifying more tokens can really be cheaper (a 5-row matmul may beat a 3-row one), and the
    policy should see that."""
    columns = [list(itertools.accumulate(col, max)) for col in zip(*itl)]
    return [list(row) for row in zip(*columns)]


def quick_profile(llm, max_k: int) -> Profile:
    """The built-in profile measured at start-up when none is given: a coarse grid (batch 1, 8, 64,
    ... up to max_num_seqs; K 0, 1, 2, 3, 4, 6, 8 up to max_k), 9 steps a point (the median: a step's
    time moves +-20% on a shared CPU), acceptance over 8 shipped prompts x 32 tokens. Interpolation
    fills in the rest; measured step times and online rates correct it while the engine runs."""
    from nanospec.bench import shipped_prompts
    largest = llm.engine.scheduler.max_num_seqs
    batch_sizes = sorted({b for b in (1, 8, 64) if b < largest} | {largest})
    ks = sorted({k for k in (0, 1, 2, 3, 4, 6, 8) if k < max_k} | {max_k})
    prompts = [llm.encode_prompt(row["prompt"], chat=True) for row in shipped_prompts()[::4]][:8]
    return measure_profile(llm, prompts, batch_sizes, ks, steps=9, max_new_tokens=32)


def check_profile_matches(profile: Profile, llm) -> None:
    """A profile of another model, proposer or device still runs, but its times are someone else's."""
    from nanospec.bench import device_name
    mine = {"target": llm.target_name, "proposer": llm.proposer_name, "device": device_name(llm.device)}
    differ = [f"{key} {profile.meta.get(key)!r} (running {value!r})" for key, value in mine.items()
              if profile.meta.get(key) not in (None, value)]
    if differ:
        warnings.warn("the dynamic-K profile was measured for another setup: " + ", ".join(differ)
                      + "; measure this one with `python -m nanospec.dynamic_k profile`", stacklevel=3)


# ---- command line ----

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m nanospec.dynamic_k", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="measure ITL(batch, K) and acceptance per position; write JSON")
    p.add_argument("--target", help="model folder, hub id or .gguf (default: offline SmolLM2-135M-Instruct)")
    p.add_argument("--draft")
    p.add_argument("--eagle")
    p.add_argument("--ngram", action="store_true")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--prompts", help="JSON lines with a 'prompt' field (default: the shipped benchmark prompts)")
    p.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of in the chat template")
    p.add_argument("--batch-sizes", default="1,2,4,8,16", help="must start at 1; the largest is max_num_seqs")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--ks", default="", help="K values to time (default: every K in 0..max-k)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per point (the median counts)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt for the acceptance rates")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    return ap.parse_args(argv)


def int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise NanospecError(f"{flag} takes comma-separated integers, got {text!r}")


def profile_command(args) -> Profile:
    from nanospec import LLM
    from nanospec.bench import shipped_prompts
    from nanospec.generate import read_prompts_file
    batch_sizes = sorted(set(int_list(args.batch_sizes, "--batch-sizes")))
    ks = sorted(set(int_list(args.ks, "--ks"))) if args.ks else list(range(args.max_k + 1))
    if not batch_sizes or batch_sizes[0] != 1:
        raise NanospecError(f"--batch-sizes must include 1, got {args.batch_sizes}")
    if len(ks) < 2 or ks[0] != 0:
        raise NanospecError(f"--ks must include 0 and at least one K >= 1, got {ks}")
    texts = read_prompts_file(args.prompts) if args.prompts else [r["prompt"] for r in shipped_prompts()]
    llm = LLM(args.target, device=args.device, dtype=args.dtype, max_num_seqs=batch_sizes[-1], draft=args.draft,
              eagle=args.eagle, ngram=args.ngram, num_speculative_tokens=ks[-1])
    prompts = [llm.encode_prompt(t, chat=not args.no_chat) for t in texts]
    log = lambda line: print(line, file=sys.stderr)
    profile = measure_profile(llm, prompts, batch_sizes, ks, args.steps, args.max_new_tokens, log)
    profile.meta["command"] = args.command_line
    profile.save(args.out)
    print(f"wrote {args.out} ({profile.meta['seconds']:.0f} s)")
    return profile


def main(argv=None) -> int:
    args = parse_args(argv)
    args.command_line = "python -m nanospec.dynamic_k " + " ".join(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: profile_command(args))


if __name__ == "__main__":
    sys.exit(main())
