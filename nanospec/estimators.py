"""Online estimators the dynamic-K policy corrects its profile with: how often drafts are found and
accepted (AcceptanceRates per draft position; SpanRates from the spans of text n-gram gets right)
and how long steps really take next to the profile (StepTimes).

Each blends what it observed with the profile's prior, and forgets at a steady rate (`decay` per
step), so that a change of workload or machine load shows within about 1 / (1 - decay) steps. They
run on the host, a few hundred floating-point operations a step, and read nothing from the device.
"""
from __future__ import annotations

import itertools

from nanospec.stats import accepted_positions


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
                requests=None, paths: list[list[int]] | None = None) -> None:
        """One decode step: request b asked for ks[b] drafts, got num_draft[b] (default ks[b]) and
        had num_accepted[b] accepted, a tree's the nodes paths[b] (stats.accepted_positions; whose
        request it was does not matter here; it does to SpanRates)."""
        n = len(self.prior)
        for counts, per_request in ((self.offered, [range(m) for m in ks]),
                                    (self.found, [range(m) for m in num_draft or ks]),
                                    (self.accepted, accepted_positions(num_accepted, paths))):
            counts[:] = [c * self.decay for c in counts]
            for positions in per_request:
                for i in positions:
                    if i < n:
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
    steps fall in a copy and the lower every measured a_i. Judged on the rates of the K it runs,
    every K looks best to itself (docs/dynamic_k.md has the replayed numbers).

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
        # id(request) -> (request, tokens of its open span)
        self.open: dict[int, tuple[object, int]] = {}
        # [i]: span-ending steps that offered draft i past the accepted
        self.past_accepted = [0.0] * len(prior)
        self.past_found = [0.0] * len(prior)                # ... and found it
        self.estimates = None                               # (a_i, d_i), worked out once a step

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                requests=None, paths: None = None) -> None:
        """One decode step (as AcceptanceRates.observe, of chains: a tree is no span of text);
        `requests` tell whose spans go on (default: the batch's slots, for a batch whose requests
        stay put)."""
        assert paths is None, "spans are chains': DynamicK reads trees by AcceptanceRates"
        requests = requests if requests is not None else range(len(ks))
        self.estimates = None
        for counts in (self.spans, self.past_accepted, self.past_found):
            counts[:] = [c * self.decay for c in counts]
        here = {id(r) for r in requests}
        # finished or preempted: its span ends where it is
        for key in [key for key in self.open if key not in here]:
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
        return sum(n * (length + 1) for length,
                   n in seen) / sum(n * (length // (k + 1) + 1) for length, n in seen)

    def drafts(self, k: int, seen=None) -> float:
        """D(k): drafts a request verifies per step at K = k."""
        m = self.prior_weight
        found_past = [(f + m * d) / (a + m) for f, a,
                      d in zip(self.past_found, self.past_accepted, self.prior_drafted)]
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
                rates, drafted = [b - a for a,
                                  b in itertools.pairwise(als)], [b - a for a, b in itertools.pairwise(ds)]
            else:
                rates, drafted = self.prior, self.prior_drafted
            self.estimates = (list(itertools.accumulate(self.blend(rates, self.prior), min)),
                              self.blend(drafted, self.prior_drafted))
        return self.estimates

    def blend(self, observed: list[float], prior: list[float]) -> list[float]:
        # the observed rates weigh what seen() counts, the open spans with it
        w, m = sum(self.spans) + len(self.open), self.prior_weight
        return [(w * x + m * p) / (w + m) for x, p in zip(observed, prior)]


class Calibration:
    """The drafter's confidence in a draft node, c (its probability that the node lies on the accepted
    path: suffix decoding's share of past continuations through it), against what is accepted. Nodes
    are counted by bin of c (BINS, equal widths) and draft position i: the sum of c over those verified
    and how many of them were accepted, each count decayed every step. A node's calibrated a is c times
    a scale, (accepted + m s) / (sum of c + m) in its cell, s the same over its bin at every position
    (with 1 for s): the drafter's own c while nothing is known, its bin's record while its position has
    none. A walk that saw a continuation once gives c = 1 to every node after it; the cells learn what
    such a node is worth at each depth."""

    BINS = 10

    def __init__(self, positions: int, decay: float = 0.97, prior_weight: float = 4.0):
        self.decay, self.prior_weight = decay, prior_weight
        self.accepted = [[0.0] * self.BINS for _ in range(positions + 1)]   # the last row: every position
        self.expected = [[0.0] * self.BINS for _ in range(positions + 1)]   # sum of c over verified nodes

    def cell(self, i: int, c: float) -> tuple[int, int]:
        return min(i, len(self.accepted) - 2), min(int(c * self.BINS), self.BINS - 1)

    def rates(self, confidence: list[float]) -> list[float]:
        """A request's nodes' a_i, non-increasing in i (dynamic_k.allocate: it takes node i before
        node i + 1, and a tree's nodes come best first, each after its parent)."""
        m, rates = self.prior_weight, []
        for i, c in enumerate(confidence):
            row, b = self.cell(i, c)
            in_bin = (self.accepted[-1][b] + m) / (self.expected[-1][b] + m)
            scale = (self.accepted[row][b] + m * in_bin) / (self.expected[row][b] + m)
            rates.append(min(1.0, c * scale, rates[-1] if rates else 1.0))
        return rates

    def observe(self, confidence: list[list[float]], num_draft: list[int], positions: list[list[int]]):
        """A step: request b verified its first num_draft[b] nodes, of confidence confidence[b], and
        had the draft positions positions[b] accepted (stats.accepted_positions)."""
        for counts in (self.accepted, self.expected):
            counts[:] = [[x * self.decay for x in row] for row in counts]
        for conf, n, hits in zip(confidence, num_draft, positions):
            hits = set(hits)
            for i, c in enumerate(conf[:n]):
                row, b = self.cell(i, c)
                for r in (row, -1):
                    self.expected[r][b] += c
                    self.accepted[r][b] += i in hits


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
        # batch -> ([w, wx, wxx, wr, wxr], step of the last update)
        self.sums: dict[int, tuple[list[float], int]] = {}
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
        # a line fitted on few points must not make a step free
        return max(r_mean + slope * (drafts - x_mean), 0.1)

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
