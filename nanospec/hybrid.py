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

A step runs the model's round only for the requests that take its drafts (none: no round); the
others' drafts ride in the step's one copy as n-gram's do (cuda_graph.StepGraphs masks the round's
writes to its own rows). Sampled, a suffix draft is one-hot (q(d) = 1) in the same rejection
sampler as the model's drafts: lossless either way. The model drafter catches up on the tokens it
did not draft for at its next round (proposer.py: its cache is always a prefix of the request).
Everything else (the round's steps, the caches, EAGLE's features) is the model drafter's.
"""
from __future__ import annotations

from nanospec.proposer import ModelProposer
from nanospec.suffix import NO_DRAFT, SuffixProposer

BIN_WIDTH = 0.5
NUM_BINS = 33          # scores 0 .. 16 (the largest K) and above
PRIOR_WEIGHT = 8.0     # drafts a bin must see before its measurement outweighs the score
PRIOR_RATE = 0.5       # the model's acceptance rate per position before it has drafted


class HybridProposer:
    drafts_on_host = False
    acceptance_in_spans = False   # model drafts: dynamic K counts acceptance per step
    host_and_model = True         # the engine asks choose() first, then runs a round for the rest

    def __init__(self, suffix: SuffixProposer, model: ModelProposer, model_k: int = 4):
        self.suffix, self.model, self.model_k = suffix, model, model_k   # the model drafts at most model_k
        self.bins = [[0.0, 0] for _ in range(NUM_BINS)]   # per score bin: accepted tokens, drafts
        self.model_drafted: list[int] = []                # per position: the model's drafts there
        self.model_accepted: list[int] = []               # and how many were accepted
        self.chosen: list[int | None] = []                # per row of the last step: the suffix draft's bin, or None
        self.model_steps = 0                              # request-steps the model drafted for

    def __getattr__(self, name):   # only for what HybridProposer itself does not define
        return getattr(self.model, name)

    def worth_of_suffix(self, score: float) -> float:
        accepted, drafts = self.bins[self.bin(score)]
        return (accepted + PRIOR_WEIGHT * score) / (drafts + PRIOR_WEIGHT)

    def worth_of_model(self, k: int) -> float:
        rates = [(a + PRIOR_RATE * PRIOR_WEIGHT) / (d + PRIOR_WEIGHT)
                 for a, d in zip(self.model_accepted + [0] * k, self.model_drafted + [0] * k)]
        worth, survive = 0.0, 1.0
        for rate in rates[:k]:   # a_i: accepted at i given accepted before i, chained
            survive *= rate
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

    def choose(self, requests, ks: list[int]) -> tuple[list[list[int]], list[int]]:
        """(the suffix drafts, [] where the model drafts; the model's K per request, 0 where not)."""
        drafts, model_ks, self.chosen = [], [], []
        model_worth = {k: self.worth_of_model(k) for k in {min(k, self.model_k) for k in ks}}   # once per K
        for req, k in zip(requests, ks):
            draft = self.suffix.draft(req, k) if k else NO_DRAFT
            k = min(k, self.model_k)
            if draft.tokens and self.worth_of_suffix(draft.score) >= model_worth[k]:
                drafts.append(draft.tokens)
                model_ks.append(0)
                self.chosen.append(self.bin(draft.score))
            else:
                drafts.append([])
                model_ks.append(k)
                self.chosen.append(None)
        return drafts, model_ks

    def verified(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """The last step's outcome, row by row as choose() made it: the measurements above."""
        for chosen, d, a in zip(self.chosen, num_draft, num_accepted):
            if chosen is not None:
                self.bins[chosen][0] += a
                self.bins[chosen][1] += 1
            elif d:
                self.model_steps += 1
                self.model_drafted.extend([0] * (d - len(self.model_drafted)))
                self.model_accepted.extend([0] * (d - len(self.model_accepted)))
                for i in range(d):   # position i was offered given i - 1 accepted: its conditional rate
                    if i <= a:
                        self.model_drafted[i] += 1
                        self.model_accepted[i] += i < a

    def finished(self, request) -> None:
        self.suffix.finished(request)

    def free(self, request) -> None:
        self.model.free(request)   # its suffix stream (Request.suffix_stream) only depends on tokens

    def twin(self, num_blocks: int) -> "HybridProposer":
        return HybridProposer(self.suffix.twin(num_blocks), self.model.twin(num_blocks), self.model_k)
