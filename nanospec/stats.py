"""The engine's figures: tokens, steps, drafts and accepted drafts per position (from which the
acceptance length and per-position acceptance rates), the K chosen, the prefix cache's hits."""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class Stats:
    generated_tokens: int = 0
    steps: int = 0                # decode / verify steps
    request_steps: int = 0        # sum over those steps of the requests in the step
    prefill_steps: int = 0
    preemptions: int = 0
    elapsed_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache (every token but the last)
    prefix_cache_hits: int = 0      # of those, the tokens found cached
    # Per draft position i, counted over request-steps: K asked of the proposer > i (offered), a draft
    # found there (drafted; an n-gram miss drafts less than offered), that draft accepted. A tree's
    # position i is its node i + 1, its (i + 1)-th most likely (accepted_positions).
    offered_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    chosen_k: dict[int, dict[int, int]] = field(default_factory=dict)   # batch size -> K -> decode steps
    # batch size -> K a request asked for -> request-steps (the step's K, or less near max_tokens;
    # with per-request K, each request's own)
    request_k: dict[int, dict[int, int]] = field(default_factory=dict)

    def record(self, k: int, ks: list[int], num_draft: list[int], num_accepted: list[int],
               paths: list[list[int]] | None = None) -> None:
        """A decode step that chose K = k for a batch whose request b asked for ks[b] <= k drafts
        (fewer near its max_tokens), got num_draft[b] and had num_accepted[b] accepted (a tree's: the
        nodes paths[b])."""
        self.steps += 1
        self.request_steps += len(num_draft)
        self.drafted_tokens += sum(num_draft)
        self.accepted_tokens += sum(num_accepted)
        count_in(self.chosen_k, len(ks), {k: 1})
        count_in(self.request_k, len(ks), Counter(ks))
        for counts, per_position in ((ks, self.offered_per_position), (num_draft, self.drafted_per_position)):
            for n in counts:
                count_positions(per_position, range(n))
        for positions in accepted_positions(num_accepted, paths):
            count_positions(self.accepted_per_position, positions)

    def add(self, other: Stats) -> None:
        """Count another run's steps and tokens in this one (stats over several generate calls)."""
        for name in (f.name for f in fields(self) if f.type in ("int", "float")):   # every counter
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("offered_per_position", "drafted_per_position", "accepted_per_position"):
            pairs = itertools.zip_longest(getattr(self, name), getattr(other, name), fillvalue=0)
            setattr(self, name, [a + b for a, b in pairs])
        for mine, theirs in ((self.chosen_k, other.chosen_k), (self.request_k, other.request_k)):
            for batch_size, ks in theirs.items():
                count_in(mine, batch_size, ks)

    def as_dict(self) -> dict:
        tps = self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0
        # Acceptance length: the tokens a request gains in a step, 1 (the target's own: recovered or
        # bonus) plus its accepted drafts. Plain decoding has 1; K drafts all accepted give K + 1.
        mean_al = 1 + self.accepted_tokens / self.request_steps if self.request_steps else 0.0
        rates = acceptance_rates(self.accepted_per_position, self.drafted_per_position)
        return {"generated_tokens": self.generated_tokens, "steps": self.steps,
                "prefill_steps": self.prefill_steps, "preemptions": self.preemptions,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "mean_acceptance_length": round(mean_al, 4), "acceptance_rate_per_position": rates,
                "drafted_tokens": self.drafted_tokens, "accepted_tokens": self.accepted_tokens,
                "chosen_k": histogram(self.chosen_k), "request_k": histogram(self.request_k),
                "elapsed_s": round(self.elapsed_s, 4), "tokens_per_second": round(tps, 2)}


def acceptance_rates(accepted: list[int], drafted: list[int]) -> list[float]:
    """Per draft position, the share of its drafts accepted (past the end of `accepted`, none were)."""
    return [round(a / d, 4) for a, d in zip(accepted + [0] * len(drafted), drafted)]


def count_in(per_batch: dict[int, dict[int, int]], batch_size: int, counts) -> None:
    per_k = per_batch.setdefault(batch_size, {})
    for k, n in counts.items():
        per_k[k] = per_k.get(k, 0) + n


def histogram(per_batch: dict[int, dict[int, int]]) -> dict[str, dict[str, int]]:
    return {str(b): {str(k): n for k, n in sorted(ks.items())} for b, ks in sorted(per_batch.items())}


def note_speculation(req, num_draft: int, positions) -> None:
    """Count a decode step's drafts in the request's own figures (its usage, in the server); positions:
    those of its accepted drafts (accepted_positions)."""
    req.spec_steps += 1
    req.drafted += num_draft
    req.accepted += len(positions)
    count_positions(req.drafted_per_position, range(num_draft))
    count_positions(req.accepted_per_position, positions)


def count_positions(per_position: list[int], positions) -> None:
    """One more at each of the positions (the list grows to hold them)."""
    for i in positions:
        per_position.extend([0] * (i + 1 - len(per_position)))
        per_position[i] += 1


def accepted_positions(num_accepted: list[int], paths: list[list[int]] | None = None) -> list:
    """The draft positions each request had accepted: a chain's first num_accepted[b]; a tree's, the
    nodes on its accepted path paths[b] (node n is position n - 1). Trees number their nodes best
    first (tree.py), so a tree's position i is its (i + 1)-th most likely node, and its acceptance
    length is 1 + the sum of its positions' rates, as a chain's."""
    if paths is None:
        return [range(a) for a in num_accepted]
    return [[n - 1 for n in path] for path in paths]
