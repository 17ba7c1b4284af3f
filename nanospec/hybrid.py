"""Hybrid drafting: per request and step, suffix decoding's draft (suffix.py) where it is expected to
be accepted at least as well as the model drafter's (EAGLE or a draft model), else the model's.

The threshold is not set by hand; both sides of the comparison are measured on the run:
  suffix  a draft of score s (its expected accepted tokens if the index's counts hold) is worth
          what suffix drafts of scores near s were accepted (per bin of BIN_WIDTH), blended with
          s itself until the bin has seen PRIOR_WEIGHT drafts;
  model   K drafts are worth sum_{i<K} a_i, a_i the measured rate at which the model's draft i
          was accepted (AL(K) - 1, dynamic_k.py), starting from PRIOR_RATE per position.
A request takes the suffix draft where its worth is at least the model's at its K (ties: suffix,
which costs no device work). The threshold in force, the lowest score that wins, is `threshold(k)`.

Priced (under dynamic K, `priced=True`), a step also weighs what its drafts cost: a suffix draft
is made on the host for free and costs only its verification, a model draft costs its share of a
round of K model steps too. Each step runs one of three plans (StepPlans): "mixed", the choice
above with its round; "suffix", every request's suffix draft and no round; "plain", no drafts. It
takes the plan of most tokens expected (each row's 1 + its drafts' worth) per second of a step,
those seconds fitted on the run. Static K does not price: it drafts as the acceptance says.

A step runs the model's round only for the requests that take its drafts (none: no round); the
others' drafts ride in the step's one copy as n-gram's do (cuda_graph.StepGraphs masks the round's
writes to its own rows). Sampled, a suffix draft is one-hot (q(d) = 1) in the same rejection
sampler as the model's drafts: lossless either way. The model drafter catches up on the tokens it
did not draft for at its next round (proposer.py: its cache is always a prefix of the request).
Everything else (the round's steps, the caches, EAGLE's features) is the model drafter's.
"""
from __future__ import annotations

from nanospec.estimators import StepTimes
from nanospec.proposer import ModelProposer, Proposal
from nanospec.suffix import SuffixProposer

BIN_WIDTH = 0.5
NUM_BINS = 33          # scores 0 .. 16 (the largest K) and above
PRIOR_WEIGHT = 8.0     # drafts a bin must see before its measurement outweighs the score
PRIOR_RATE = 0.5       # the model's acceptance rate per position before it has drafted
PROBE_EVERY = 16       # priced: every this many steps at a batch size, a plan not chosen runs once


# a priced step's plans: no drafts; suffix drafts only; the acceptance's
PLANS = ("plain", "suffix", "mixed")


class StepPlans:
    """A priced hybrid's choice of plan for a step, by goodput: the tokens a plan is expected to gain
    over the seconds its steps take. Each plan's seconds are fitted on its own steps, per batch size
    as a line in the drafts a request verifies (estimators.StepTimes, fed the seconds over the first
    step's: a profile of one step that takes the first step's time), so that a short suffix draft
    is priced as one. A plan no step has run yet runs first (the acceptance's plan before the
    others); every PROBE_EVERY-th step at a batch size runs one of the plans not chosen, in turn, so
    all of their times stay measured."""

    def __init__(self):
        self.seconds = {plan: StepTimes() for plan in PLANS}
        self.steps: dict[int, int] = {}             # batch size -> priced steps there so far
        self.chosen = {plan: 0 for plan in PLANS}   # steps that ran each plan
        self.unit = None                            # the first step's seconds

    def observe(self, batch: int, plan: str, drafts: float, seconds: float) -> None:
        self.unit = self.unit or seconds
        self.seconds[plan].observe(batch, drafts, seconds / self.unit)

    def choose(self, batch: int, expected: dict[str, tuple[float, float]]) -> str:
        """The plan a step of `batch` requests runs; expected: each plan's (tokens it would gain,
        drafts a request would verify)."""
        unmeasured = [p for p in reversed(PLANS) if p in expected and not self.seconds[p].now]
        if unmeasured:
            plan = unmeasured[0]
        else:
            goodput = {p: gain / self.seconds[p].ratio(batch, drafts)   # tokens per (fitted) second
                       for p, (gain, drafts) in expected.items()}
            ranked = sorted(goodput, key=goodput.get, reverse=True)
            self.steps[batch] = self.steps.get(batch, 0) + 1
            probe, turn = divmod(self.steps[batch], PROBE_EVERY)
            plan = ranked[1 + probe % (len(ranked) - 1)] if turn == 0 and len(ranked) > 1 else ranked[0]
        self.chosen[plan] += 1
        return plan


class HybridProposer:
    # Whatever it does not define is its model's (__getattr__): drafts_on_host and acceptance_in_spans
    # are False (its model's drafts are drawn on the device; dynamic K counts acceptance per step).
    host_and_model = True         # suffix drafts on the host beside the model's round, in one step

    def __init__(self, suffix: SuffixProposer, model: ModelProposer, model_k: int = 4, priced: bool = False):
        self.suffix, self.model, self.model_k = suffix, model, model_k   # the model drafts at most model_k
        self.plans = StepPlans() if priced else None                      # priced: the plans' costs weighed
        self.plan = "plain"                                               # the plan of the last step
        self.bins = [[0.0, 0] for _ in range(NUM_BINS)]   # per score bin: accepted tokens, drafts
        self.model_drafted = [0] * model_k                # per position: the model's drafts there
        self.model_accepted = [0] * model_k               # and how many were accepted
        # per row of the last step: the suffix draft's bin, or None
        self.chosen: list[int | None] = []
        self.model_steps = 0                              # request-steps the model drafted for

    def __getattr__(self, name):   # only for what HybridProposer itself does not define
        return getattr(self.model, name)

    def worth_of_suffix(self, score: float) -> float:
        accepted, drafts = self.bins[self.bin(score)]
        return (accepted + PRIOR_WEIGHT * score) / (drafts + PRIOR_WEIGHT)

    def worth_of_model(self, k: int) -> float:
        """K = k <= model_k drafts' expected accepted tokens."""
        worth, survive = 0.0, 1.0
        for a, d in zip(self.model_accepted[:k], self.model_drafted[:k]):
            survive *= (a + PRIOR_RATE * PRIOR_WEIGHT) / (d + PRIOR_WEIGHT)   # a_i, given accepted before i
            worth += survive
        return worth

    def threshold(self, k: int) -> float | None:
        """The lowest score whose suffix draft wins at K = k now (None: none does)."""
        model = self.worth_of_model(min(k, self.model_k))
        wins = [b * BIN_WIDTH for b in range(NUM_BINS) if self.worth_of_suffix(b * BIN_WIDTH) >= model]
        return wins[0] if wins else None

    @staticmethod
    def bin(score: float) -> int:
        return min(int(score / BIN_WIDTH), NUM_BINS - 1)

    def propose(self, requests, ks: list[int]) -> Proposal:
        """The suffix drafts of the rows choose() gives them, a round of the model's for the others
        (a row its pool has no room for drafts nothing)."""
        num_draft = [min(k, self.model.max_drafts(r)) for r, k in zip(requests, ks)]
        if not max(num_draft):
            return Proposal(num_draft)
        host_drafts, model_ks = self.choose(requests, num_draft)
        model = self.model.propose(requests, model_ks)   # 0 for the suffix rows and those left out
        return Proposal([len(h) or d for h, d in zip(host_drafts, model.num_draft)], host_drafts, model.round)

    def choose(self, requests, ks: list[int]) -> tuple[list[list[int]], list[int]]:
        """(the suffix drafts, [] where the model drafts; the model's K per request, 0 where not).
        Priced: the drafts of the plan that pays (StepPlans)."""
        suffix_drafts = self.suffix.drafts(requests, ks)   # each row's, if any: the plan without a round
        capped = [min(k, self.model_k) for k in ks]
        model_worth = {k: self.worth_of_model(k) for k in set(capped)}   # once per K
        suffix_worth = [self.worth_of_suffix(d.score) if d.tokens else 0.0 for d in suffix_drafts]
        takes_suffix = [bool(d.tokens) and w >= model_worth[k] for d, w, k in zip(suffix_drafts, suffix_worth,
                                                                                  capped)]
        model_ks = [0 if s else k for s, k in zip(takes_suffix, capped)]
        plan = self.priced_plan(suffix_drafts, suffix_worth, takes_suffix, model_ks, model_worth) \
            if self.plans else "mixed"
        if plan != "mixed":   # every row's suffix draft, or none; no round
            takes_suffix = [plan == "suffix" and bool(d.tokens) for d in suffix_drafts]
            model_ks = [0] * len(ks)
        drafts = [d.tokens if s else [] for d, s in zip(suffix_drafts, takes_suffix)]
        self.chosen = [self.bin(d.score) if s else None for d, s in zip(suffix_drafts, takes_suffix)]
        self.plan = "mixed" if any(model_ks) else "suffix" if any(drafts) else "plain"
        return drafts, model_ks

    def priced_plan(self, suffix_drafts, suffix_worth, takes_suffix, model_ks, model_worth) -> str:
        """The plan StepPlans chooses, given each plan's tokens expected (each row's 1 + its drafts'
        worth) and the drafts a request would verify; "mixed" is the acceptance's choice above."""
        batch = len(suffix_drafts)
        suffix_tokens = sum(len(d.tokens) for d in suffix_drafts)
        mixed = [(w, len(d.tokens)) if s else (model_worth[k], k)   # each row's (worth, drafts)
                 for d, w, s, k in zip(suffix_drafts, suffix_worth, takes_suffix, model_ks)]
        plans = dict(plain=(batch, 0.0), suffix=(batch + sum(suffix_worth), suffix_tokens / batch),
                     mixed=(batch + sum(w for w, _ in mixed), sum(n for _, n in mixed) / batch))
        if not any(model_ks):   # the acceptance's plan is the suffix drafts' own
            del plans["mixed"]
        if not suffix_tokens:
            del plans["suffix"]
        return self.plans.choose(batch, plans)

    def verified(self, num_draft: list[int], num_accepted: list[int], seconds: float) -> None:
        """The last step's outcome, row by row as choose() made it, and its time: the measurements above."""
        # (asked for drafts, a step may find none and not ask choose(): a plain step, no row counts)
        if self.plans:
            plan = self.plan if any(num_draft) else "plain"
            self.plans.observe(len(num_draft), plan, sum(num_draft) / len(num_draft), seconds)
        for chosen, d, a in zip(self.chosen, num_draft, num_accepted):
            if chosen is not None and d:
                self.bins[chosen][0] += a
                self.bins[chosen][1] += 1
            elif d:   # (d <= model_k)
                self.model_steps += 1
                # position i was offered given i - 1 accepted (i <= a): its conditional rate
                for i in range(min(d, a + 1)):
                    self.model_drafted[i] += 1
                    self.model_accepted[i] += i < a

    def finished(self, request) -> None:
        self.suffix.finished(request)
        # EAGLE: what its head was not fed, as the request's rows took suffix drafts
        self.model.finished(request)

    def free(self, request) -> None:
        self.model.free(request)   # its suffix stream (Request.suffix_stream) only depends on tokens

    def twin(self, num_blocks: int) -> "HybridProposer":
        return HybridProposer(self.suffix.twin(num_blocks), self.model.twin(num_blocks), self.model_k,
                              priced=self.plans is not None)
