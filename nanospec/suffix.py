"""Suffix decoding (Oliaro et al. 2024; Snowflake's ArcticInference, vLLM's method "suffix"): no
model. Draft what followed the context's suffix where those tokens occurred before, in the request's
own prompt and output and in recent requests' prompts and outputs (agents and multi-turn chats
repeat what earlier requests produced: the same file edited again, the same JSON shape).

It keeps the semantics of a suffix tree of depth MAX_DEPTH with a count per node (how many earlier
occurrences pass through it), without building one: a node is the set of positions of a token
stream where the L tokens before match the context's last L. A draft walks down from the node
greedily, each next token the one that most often followed (its probability: its count over its
parent's), stopping when the path's probability falls below MIN_TOKEN_PROB or at the length the
match earns, MAX_SPEC_FACTOR * L + MAX_SPEC_OFFSET tokens (and the policy's K). Its score, the sum
of the path's probabilities, is the draft's expected number of accepted tokens if the past predicts
the future: every match length is tried and the best score wins. The walk's defaults are vLLM's:
depth 24, factor 1, probability 0.1 and offset 0 (ArcticInference's max_spec_offset, which vLLM
does not expose). The proposer's offset is EXTRA_TOKENS, 3: a short match may draft as far as prompt
lookup does after one matching token, and these extra tokens are priced step by step (ExtraTokens):
drafted where their measured acceptance pays for their verification (a CPU at batch 1, a GPU below
its compute bound), not where it does not (a CPU at batch 8). `--suffix-max-spec-offset 0` is vLLM's
rule exactly.

Two kinds of stream, one walk:
  RequestStream  a request's own tokens; its candidates are the positions after the most recent
                 MAX_CANDIDATES earlier occurrences of its last token.
  GlobalIndex    finished requests' prompts and outputs, at most max_requests of them and
                 max_tokens tokens (oldest dropped first, a segment at a time); its candidates are
                 the positions after the most recent MAX_CANDIDATES occurrences of the context's
                 last two tokens, looked up in sorted bigram indexes of RUN_SEGMENTS sealed segments
                 each (one binary search per index for a whole batch). 16 bytes a token once sealed
                 (tokens, keys, positions); the open segment is a dict of position lists.

Drafts are one-hot (q(d) = 1), so the verification is the n-gram one: greedy output equals plain
decoding, and seeded sampled output equals plain sampling token for token (sampler.verify_one_hot),
whatever the index holds: other requests can change how fast a request decodes, never what it says.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from nanospec.estimators import StepTimes
from nanospec.proposer import Proposal, Proposer
from nanospec.tree import chain, child_ranks, depths

MAX_DEPTH = 24            # the longest suffix of the context matched
MIN_TOKEN_PROB = 0.1      # a draft stops where its path's probability falls below this
MAX_SPEC_FACTOR = 1.0     # a match of L tokens drafts at most L * factor + offset tokens
MAX_SPEC_OFFSET = 0.0     # the walk's (vLLM's); the proposer's is EXTRA_TOKENS
MAX_CANDIDATES = 256      # the most recent occurrences of a key a draft reads (bounds its host time)
# sealed segments merged into one sorted run (GlobalIndex): fewer searches, small copies
RUN_SEGMENTS = 4
SEPARATOR = -1            # between requests in the global stream: no match or draft crosses it
# the proposer's max_spec_offset: at most this many extra tokens, each priced (ExtraTokens)
EXTRA_TOKENS = 3
EXTRA_PRIOR = 0.5         # an extra token's chance to be accepted before any has been verified
EXTRA_PRIOR_WEIGHT = 8.0  # the drafts its measurement must see to outweigh the prior
# every this many steps the extra tokens are drafted whatever their price (kept measured)
EXTRA_PROBE_EVERY = 64
DECAY = 0.97              # per step, of the tokens a request gains a step (AL) and its drafts

# LLM(...)'s suffix settings (vLLM's suffix_decoding_* three and the offset) -> SuffixProposer's arguments
LLM_SETTINGS = dict(suffix_max_spec_offset="max_spec_offset", suffix_max_cached_requests="max_requests",
                    suffix_max_spec_factor="max_spec_factor", suffix_min_token_prob="min_token_prob")


@dataclass
class Draft:
    tokens: list[int]
    score: float = 0.0       # expected accepted tokens: the sum of its nodes' path probabilities
    # its last levels that are past the length its match earns (L * factor): the offset's
    extra: int = 0
    parents: list[int] | None = None   # a tree's parent list over [last token, tokens] (tree.py); None: chain
    probs: list[float] = field(default_factory=list)   # each node's path probability (best first)

    @property
    def depth(self) -> int:
        return max(depths(self.parents)) if self.parents else len(self.tokens)


NO_DRAFT = Draft([])
OFF_THE_END = -2             # a window's entry past its stream's ends


def windows(stream: np.ndarray, positions: np.ndarray, depth: int, ahead: int) -> tuple[np.ndarray,
                                                                                        np.ndarray]:
    """For each position p (where a continuation starts): the `depth` tokens before it, nearest
    first, and the `ahead` tokens from it: [m, depth] and [m, ahead] (views of one gather),
    OFF_THE_END outside stream."""
    index = positions[:, None] + np.arange(-depth, ahead)
    taken = stream.take(index, mode="clip")
    taken[(index < 0) | (index >= len(stream))] = OFF_THE_END
    return taken[:, depth - 1::-1], taken[:, depth:]


def walk(after: np.ndarray, limit: int, min_prob: float, budget: int, branches: int = 1,
         shape: list[int] | None = None) -> Draft:
    """Down the tree from a node whose occurrences continue as the rows of after [m, >= limit]. A
    candidate's probability is its parent's times its count over the parent's (occurrences that end
    there count in the parent, in no child); the most probable candidates are taken, best first,
    until `budget` nodes, none below min_prob and none deeper than limit, at most
    `branches` children a node, its most frequent continuations (ties: the smallest id first). With
    one branch that is a chain, the most frequent next token at each step; with more, the draft is a
    tree (its parent list: parents come first, as a child is no more probable than its parent).
    shape: a static tree (tree.parse_static_tree) instead: a node's children are its shape node's,
    the one of rank r its r-th most frequent continuation (those that exist and pass min_prob)."""
    below = {}   # a shape node's children: (rank, shape node)
    for node, (parent, rank) in enumerate(zip(shape or (), child_ranks(shape or [-1]))):
        if node:
            below.setdefault(parent, []).append((rank, node))
    tokens, parents, probs, score, order = [], [-1], [], 0.0, itertools.count()
    # a heap of (-probability, order, token, parent node, its rows of after, depth, shape node)
    candidates = []

    def add_children(rows: np.ndarray, prob: float, node: int, depth: int, at: int) -> None:
        if depth >= limit:
            return
        column = rows[:, depth]
        if (column == column[0]).all():
            counts = {int(column[0]): len(column)}
        else:   # (a Counter beats np.unique on the few rows)
            counts = Counter(t for t in column.tolist() if t >= 0)
        ranked = sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))
        for rank, shape_node in below.get(at, []) if shape else zip(range(branches), [0] * branches):
            if rank >= len(ranked):
                break
            token, count = ranked[rank]
            child = prob * count / len(column)
            if token >= 0 and child >= min_prob:
                heapq.heappush(candidates, (-child, next(order), token, node, rows[column == token],
                                            depth + 1, shape_node))

    add_children(after, 1.0, 0, 0, 0)
    while candidates and len(tokens) < budget:
        minus_prob, _, token, parent, rows, depth, at = heapq.heappop(candidates)
        tokens.append(token)
        parents.append(parent)
        probs.append(-minus_prob)
        score -= minus_prob
        add_children(rows, -minus_prob, len(tokens), depth, at)
    return Draft(tokens, score, parents=parents if branches > 1 or shape else None, probs=probs)


def best_draft(before: np.ndarray, after: np.ndarray, context: list[int], k: int, min_match: int,
               min_prob: float = MIN_TOKEN_PROB, factor: float = MAX_SPEC_FACTOR,
               offset: float = MAX_SPEC_OFFSET, branches: int = 1,
               shape: list[int] | None = None) -> Draft:
    """The best-scoring draft over every match length L >= min_match: the occurrences (rows of
    windows) whose L tokens before match the context's last L are the node of that suffix. A chain
    has at most L * factor + offset tokens (and k); a tree (branches > 1, or a static shape) k nodes,
    none deeper."""
    if not len(before):
        return NO_DRAFT
    suffix = np.array(context[::-1][:before.shape[1]])
    matched = np.cumprod(before[:, :len(suffix)] == suffix[None, :], axis=1).sum(1)   # [m]: each one's L
    best = NO_DRAFT
    for length in sorted({m for m in matched.tolist() if m >= min_match}, reverse=True):   # deepest first
        limit = min(k, int(length * factor + offset))
        if best.score >= limit:   # a score is at most its draft's depth: no shorter match can win
            break
        node = matched >= length   # the same rows for every L down to the next distinct length
        tree = branches > 1 or shape is not None
        draft = walk(after[node], limit, min_prob, k if tree else limit, branches, shape)
        if draft.score > best.score:
            best = draft
            best.extra = max(0, draft.depth - int(length * factor))
    return best


class RequestStream:
    """A request's tokens (prompt and output) as a growing array: the per-request index."""

    def __init__(self):
        self.tokens = np.zeros(256, dtype=np.int32)
        self.size = 0

    def sync(self, tokens: list[int]) -> None:
        """Catch up on the request's new tokens (only ever appended)."""
        if len(tokens) > len(self.tokens):
            self.tokens = np.resize(self.tokens, 2 * len(tokens))
        self.tokens[self.size:len(tokens)] = tokens[self.size:]
        self.size = len(tokens)

    def draft(self, k: int, **walk_args) -> Draft:
        stream = self.tokens[:self.size]
        if self.size < 2:
            return NO_DRAFT
        # after each earlier last token
        positions = np.flatnonzero(stream[:-1] == stream[-1])[-MAX_CANDIDATES:] + 1
        return best_draft(*windows(stream, positions, MAX_DEPTH, k), stream[-MAX_DEPTH:].tolist(), k, 1,
                          **walk_args)


def bigram_keys(tokens: np.ndarray) -> np.ndarray:
    """Key of the bigram ending at each position i >= 1 (tokens[i - 1], tokens[i]), as one int64."""
    return (tokens[:-1].astype(np.int64) << 32) | (tokens[1:].astype(np.int64) & 0xFFFFFFFF)


class Run:
    """Consecutive sealed segments as one stream (tokens), with every bigram's key sorted by key and
    then by position, and the position after it (follows): a key's occurrences are one stretch of
    keys, found by one binary search for a whole batch, its most recent last. 16 bytes a token."""

    def __init__(self):
        self.tokens = np.zeros(0, dtype=np.int32)
        self.keys = np.zeros(0, dtype=np.int64)
        self.follows = np.zeros(0, dtype=np.int32)
        self.segments: deque[tuple[int, int]] = deque()   # each segment's (tokens, requests), oldest first

    def append(self, stream: np.ndarray, requests: int) -> None:
        """Merge a segment in: its bigrams after every equal key already here (older positions), so
        that each key's stretch stays in order of position. O(the run)."""
        keys = bigram_keys(stream)
        order = np.argsort(keys, kind="stable")
        # the bigram ending at order + 1
        keys, follows = keys[order], (order + 2 + len(self.tokens)).astype(np.int32)
        at = np.searchsorted(self.keys, keys, "right")
        self.keys, self.follows = np.insert(self.keys, at, keys), np.insert(self.follows, at, follows)
        self.tokens = np.concatenate([self.tokens, stream])
        self.segments.append((len(stream), requests))

    def drop_oldest(self) -> tuple[int, int]:
        """Drop the oldest segment, its tokens and every bigram ending in it; returns its (tokens,
        requests)."""
        size, requests = self.segments.popleft()
        kept = self.follows > size   # the bigram ending at follows - 1 >= size
        self.keys, self.follows = self.keys[kept], self.follows[kept] - size
        self.tokens = self.tokens[size:].copy()
        return size, requests

    def lookup(self, keys: np.ndarray) -> list[list[int]]:
        """keys: a batch's keys, then each of them + 1. Returns lo, hi: key i's stretch is
        self.keys[lo[i]:hi[i]] (the keys are integers: where key + 1 would go, key's stretch ends)."""
        return np.searchsorted(self.keys, keys).reshape(2, -1).tolist()


class GlobalIndex:
    """Recent finished requests' prompts and outputs: at most max_requests requests and max_tokens
    tokens, in segments of at most segment_tokens tokens (and 1/16 of max_requests), the oldest
    segment dropped first (a segment is at most 1/16 of max_tokens too, so that dropping one never
    drops them all). A request is added whole when it finishes, to the open segment (a dict
    of position lists); a full one is sealed into the newest run of sealed segments (Run), a new
    run every RUN_SEGMENTS segments: a step's lookup is a binary search per run for its whole batch
    (not per request and segment), and sealing or dropping a segment copies one run, not the index."""

    def __init__(self, max_requests: int = 10_000, max_tokens: int = 1 << 23, segment_tokens: int = 1 << 17):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        # at most 1/16 of the token bound, and 2 (a request cut to its last token, and the separator)
        self.segment_tokens = max(2, min(segment_tokens, max_tokens // 16))
        self.segment_requests = max(1, max_requests // 16)
        self.runs: deque[Run] = deque()   # oldest first
        self.open_tokens, self.open_size = np.zeros(1024, dtype=np.int32), 0   # the open segment's stream
        self.open_follows: dict[int, list[int]] = {}   # bigram key -> positions after it in the open stream
        self.open_requests = 0
        self.num_requests = self.num_tokens = 0

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Every sealed segment's (tokens, requests), oldest first."""
        return [segment for run in self.runs for segment in run.segments]

    def add(self, tokens: list[int]) -> None:
        if not self.max_requests:   # an index of no requests (vLLM's max_cached_requests 0)
            return
        tokens = tokens[-self.segment_tokens + 1:]   # a request longer than a segment keeps its end
        start, end = self.open_size, self.open_size + len(tokens) + 1
        if end > len(self.open_tokens):
            self.open_tokens = np.resize(self.open_tokens, 2 * end)
        self.open_tokens[start:end] = tokens + [SEPARATOR]
        self.open_size = end
        for i, key in enumerate(bigram_keys(self.open_tokens[max(start - 1, 0):end]).tolist(), max(start, 1)):
            self.open_follows.setdefault(key, []).append(i + 1)   # the bigram ending at i
        self.open_requests += 1
        self.num_requests += 1
        self.num_tokens += len(tokens) + 1
        if self.open_size >= self.segment_tokens or self.open_requests >= self.segment_requests:
            self.seal()
        while self.runs and (self.num_requests > self.max_requests or self.num_tokens > self.max_tokens):
            self.drop_oldest()

    def seal(self) -> None:
        if not self.runs or len(self.runs[-1].segments) >= RUN_SEGMENTS:
            self.runs.append(Run())
        self.runs[-1].append(self.open_tokens[:self.open_size], self.open_requests)
        self.open_tokens, self.open_size = np.zeros(1024, dtype=np.int32), 0
        self.open_follows, self.open_requests = {}, 0

    def drop_oldest(self) -> None:
        size, requests = self.runs[0].drop_oldest()
        if not self.runs[0].segments:
            self.runs.popleft()
        self.num_requests -= requests
        self.num_tokens -= size

    def draft(self, context: list[int], k: int, **walk_args) -> Draft:
        return self.drafts([context], [k], **walk_args)[0]

    def drafts(self, contexts: list[list[int]], ks: list[int], **walk_args) -> list[Draft]:
        """Each context's best draft (at most its K tokens) over the MAX_CANDIDATES most recent
        occurrences of its last two tokens: the open segment's, then the sealed ones' (each
        occurrence's windows read from its own stream; counts add up over all of them)."""
        keys = [int(bigram_keys(np.array(c[-2:]))[0]) if len(c) >= 2 else 0 for c in contexts]
        # each key's stretch ends at key + 1's
        searched = np.array(keys + [key + 1 for key in keys], dtype=np.int64)
        stretches = [(run, *run.lookup(searched)) for run in reversed(self.runs)]   # newest first
        out = []
        for i, (context, key, k) in enumerate(zip(contexts, keys, ks)):
            if len(context) < 2 or not k or not self.num_requests:
                out.append(NO_DRAFT)
                continue
            found, wanted = [], MAX_CANDIDATES
            if key in self.open_follows:
                positions = np.array(self.open_follows[key][-wanted:])
                found.append(windows(self.open_tokens[:self.open_size], positions, MAX_DEPTH, k))
                wanted -= len(positions)
            for run, lo, hi in stretches:
                if wanted <= 0:
                    break
                if hi[i] > lo[i]:   # its most recent occurrences there
                    start = max(lo[i], hi[i] - wanted)
                    found.append(windows(run.tokens, run.follows[start:hi[i]], MAX_DEPTH, k))
                    wanted -= hi[i] - start
            if not found:
                out.append(NO_DRAFT)
                continue
            before, after = (np.concatenate(parts) for parts in zip(*found))
            out.append(best_draft(before, after, context[-MAX_DEPTH:], k, 2, **walk_args))
        return out


class ExtraTokens:
    """Prices the offset: a draft's tokens past the length its match earns (L * factor). Behind a
    short match they are accepted less often than the tokens before them, and verifying a token that
    is rejected costs a step time, so each is drafted only where it pays. The i-th extra token's worth
    w_i is the measured chance that it is accepted (it and every token before it); verifying one more
    token costs s * AL / r tokens: s the step's seconds per draft per request and r its seconds (a
    line per batch size in the drafts a request verifies, fitted on the run's own steps: StepTimes,
    whose slope the drafts' natural spread of lengths measures), AL the tokens a request gains a step
    (adding w tokens at that cost pays iff the tokens per second grow). Where verifying is nearly free
    (a GPU below its compute bound, a CPU at batch 1) the extra tokens are drafted; on a CPU at batch
    8, where verifying a draft costs about a quarter of a request's share of the step, they are not
    (docs/suffix_decoding.md)."""

    def __init__(self, most: int):
        self.most = most
        self.drafted = [0] * most      # per extra position i: steps whose draft had an i-th extra token
        self.accepted = [0] * most     # ... and how many had it accepted
        self.times = StepTimes()
        self.unit = None               # the first step's seconds (StepTimes keeps ratios to it)
        self.gained = self.rows = self.drafts = 0.0   # decayed: tokens gained, request-steps, drafts
        self.steps = 0

    def worth(self, i: int) -> float:
        return (self.accepted[i] + EXTRA_PRIOR * EXTRA_PRIOR_WEIGHT) / (self.drafted[i] + EXTRA_PRIOR_WEIGHT)

    def allowed(self, batch: int) -> int:
        """How many extra tokens a draft may have in this step of `batch` requests."""
        self.steps += 1
        if not self.times.now or self.steps % EXTRA_PROBE_EVERY == 0:
            return self.most
        x = self.drafts / self.rows                    # drafts a request verifies, lately
        r = self.times.ratio(batch, x)                 # a step's seconds (in the first step's)
        s = self.times.ratio(batch, x + 1) - r         # ... and what one more draft a request adds
        cost = s * (self.gained / self.rows) / r       # one more draft's seconds, in tokens: s * AL / r
        n = 0
        while n < self.most and self.worth(n) >= cost:
            n += 1
        return n

    def observe(self, drafts: list[Draft], num_draft: list[int], num_accepted: list[int],
                seconds: float) -> None:
        """The step the drafts were made for: what was accepted, and its seconds."""
        self.unit = self.unit or seconds
        self.times.observe(len(num_draft), sum(num_draft) / len(num_draft), seconds / self.unit)
        self.gained = DECAY * self.gained + sum(num_accepted) + len(num_accepted)
        self.rows = DECAY * self.rows + len(num_accepted)
        self.drafts = DECAY * self.drafts + sum(num_draft)
        for draft, d, a in zip(drafts, num_draft, num_accepted):
            base = draft.depth - draft.extra   # the extra levels are the draft's last
            # those verified (a step may verify fewer, or pad)
            for i in range(min(draft.extra, min(d, draft.depth) - base)):
                self.drafted[i] += 1
                self.accepted[i] += a > base + i


class SuffixProposer(Proposer):
    """Drafts the better of the request's own suffix match and the global index's; on the host like
    n-gram, its drafts riding in the step's one copy. Its extra tokens (max_spec_offset) are priced
    step by step (ExtraTokens); a hybrid that drafts with it (drafts(), not propose()) takes them all."""

    drafts_on_host = True
    confident = True   # a node's path probability: the share of the past's continuations through it

    def __init__(self, device: torch.device, max_requests: int = 10_000, max_tokens: int = 1 << 23,
                 min_token_prob: float = MIN_TOKEN_PROB, max_spec_factor: float = MAX_SPEC_FACTOR,
                 max_spec_offset: int = EXTRA_TOKENS, branches: int = 1,
                 shape: list[int] | None = None):
        self.device = device
        self.settings = dict(max_requests=max_requests, max_tokens=max_tokens, min_token_prob=min_token_prob,
                             max_spec_factor=max_spec_factor, max_spec_offset=max_spec_offset,
                             branches=branches, shape=shape)
        # branches > 1: each draft a tree of K nodes, a node's most frequent continuations its children;
        # shape: a static tree's parent list (a node's children: the continuations of its ranks)
        self.walk_args = dict(min_prob=min_token_prob, factor=max_spec_factor, offset=max_spec_offset,
                              branches=branches, shape=shape)
        self.trees = branches > 1 or shape is not None
        # its chains are the text after a match, as n-gram's; a tree is no span of text
        self.acceptance_in_spans = not self.trees
        self.global_index = GlobalIndex(max_requests, max_tokens)
        self.extras = ExtraTokens(int(max_spec_offset)) if max_spec_offset else None
        self.drafts_made: list[Draft] = []   # the last step's, row by row (propose)

    def drafts(self, requests, ks: list[int], offset: float | None = None) -> list[Draft]:
        """Each request's draft (NO_DRAFT where its K is 0), the better of its own stream's and the
        global index's (looked up for the batch at once), with at most `offset` extra tokens
        (default: max_spec_offset)."""
        walk_args = self.walk_args if offset is None else {**self.walk_args, "offset": offset}
        for request in requests:
            request.suffix_stream = request.suffix_stream or RequestStream()
            request.suffix_stream.sync(request.tokens)
        streams = [r.suffix_stream for r in requests]
        contexts = [s.tokens[max(0, s.size - MAX_DEPTH):s.size].tolist() for s in streams]
        theirs = self.global_index.drafts(contexts, ks, **walk_args)
        mine = [s.draft(k, **walk_args) if k else NO_DRAFT for s, k in zip(streams, ks)]
        return [t if t.score > m.score else m for t, m in zip(theirs, mine)]

    def propose(self, requests, ks) -> Proposal:
        self.drafts_made = self.drafts(requests, ks,
                                       self.extras.allowed(len(requests)) if self.extras else None)
        drafts = self.drafts_made
        parents = [d.parents or chain(len(d.tokens)) for d in drafts] if self.trees else None
        return Proposal([len(d.tokens) for d in drafts], [d.tokens for d in drafts], parents=parents,
                        confidence=[d.probs for d in drafts])

    def verified(self, num_draft: list[int], num_accepted: list[int], seconds: float) -> None:
        if self.extras:
            self.extras.observe(self.drafts_made, num_draft, num_accepted, seconds)

    def finished(self, request) -> None:
        self.global_index.add(request.tokens)

    def twin(self, num_blocks: int) -> "SuffixProposer":
        """The same settings and an empty global index: an engine of its own learns from its own requests."""
        return SuffixProposer(self.device, **self.settings)
