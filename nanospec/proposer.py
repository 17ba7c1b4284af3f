"""Proposers: who guesses the next K tokens that the target then verifies in one forward pass.

One interface for every kind of guesser; the engine asks for one Proposal per decode step and
treats every proposal alike, whoever made it:
  propose(requests, ks) -> Proposal   up to ks[b] drafts for request b: made on the host (n-gram,
                               suffix: lists, sent with the step's other host data), or planned as a
                               round of draft steps that cuda_graph.StepGraphs runs on the device
                               (draft model, EAGLE: first_step, then next_step; a draft
                               model's graphed round: catch_up_step),
                               or both (the hybrid)
  max_drafts(request)          the most drafts it can make for the request now
  observe(request, features)   the target's features for positions it just cached for good (EAGLE)
  rollback(request)            forget what the proposer cached past the request's committed tokens
  free(request)                the request finished or was preempted: release the proposer's state
  finished(request)            the request finished (suffix decoding learns from it)
  verified(num_draft, accepted, seconds)  how the step it drafted for went (the hybrid learns from it)

NgramProposer    prompt lookup: continue the longest recent suffix as it went on before.
SuffixProposer   (suffix.py) suffix decoding: the most frequent continuation of the longest match,
                 in the request's own tokens and in recent requests'.
HybridProposer   (hybrid.py) per request and step, the suffix draft or a model drafter's.
OracleProposer   the target's own greedy continuation, recorded beforehand (benchmarks: the ceiling).
DraftModelProposer  a smaller model with the target's tokenizer and its own paged KV cache.
EagleProposer    an EAGLE-1 / EAGLE-3 head (eagle.py) fed the target's hidden states.

Invariant of the model-based proposers: after rollback their cache holds only positions whose
inputs are committed tokens (and, for EAGLE, real target features), so it is always a prefix of the
request; the next round first catches up on what it has not seen, then drafts. Both size their
pool like the target's: a request never holds more proposer positions than target positions. With
prefix caching a request may still hold more blocks of the proposer's pool than of the target's
(the two pools' hits and evictions differ), so a round takes only the rows whose blocks fit; a row
that does not fit drafts nothing that step (ModelProposer.with_room).

Prefix caching (kv_cache.BlockAllocator): the proposer's cache publishes its blocks of committed
inputs after each rollback, keyed by the tokens that made them (`shift`: EAGLE's element i reads
t_{i+1}); a new request's proposer skips what its own cache holds, and with EAGLE, which needs the
target's features, the target skips only that much too (ModelProposer.cached_prefix).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanospec.kv_cache import BlockTable, KVCache, MetadataShape, build_metadata, pack_metadata
from nanospec.sampler import DRAFT, SamplingBatch, pick, target_probs, uniform_noise
from nanospec.tree import tree_shape


@dataclass
class Proposal:
    """One step's drafts for its batch. Drafts made on the host ride in the step's one copy; a
    round's are drawn on the device before the verify reads them. No drafts at all: plain decoding."""
    num_draft: list[int]                             # drafts request b verifies (0: none)
    host_drafts: list[list[int]] | None = None       # request b's drafts made on the host ([]: none)
    round: Round | None = None                       # a model proposer's round of draft steps
    # host drafts as trees (tree.py): request b's parent list over [last token, its drafts]
    parents: list[list[int]] | None = None
    tree: tuple[int, int] | None = None   # a tree step's largest depth and branching (None: chains)
    # request b's drafts: the drafter's probability that each lies on the accepted path (None: it has none)
    confidence: list[list[float]] | None = None

    def __post_init__(self):
        if self.parents is not None and self.tree is None:
            self.tree = tree_shape(self.parents)

    def keep(self, counts: list[int]) -> Proposal:
        """Host drafts cut to request b's first counts[b] (a tree's first nodes: a node's parent comes
        before it, so they are a tree). Host drafts only: a round's drafts are on the device."""
        assert self.round is None

        def cut(rows, more=0):
            return None if rows is None else [row[:n + more] for row, n in zip(rows, counts)]
        return Proposal([min(d, n) for d, n in zip(self.num_draft, counts)], cut(self.host_drafts),
                        parents=cut(self.parents, 1), confidence=cut(self.confidence))


class Proposer:
    capture_layers: tuple[int, ...] = ()    # target layers whose input hidden states EAGLE-3 reads
    needs_features = False
    drafts_on_host = False                  # all its drafts are made on the host (n-gram, suffix)
    # dynamic K models acceptance by spans of text (estimators.SpanRates)
    acceptance_in_spans = False
    host_and_model = False                  # host drafts beside a round in one step (the hybrid)
    confident = False                       # its host drafts come with Proposal.confidence

    def max_drafts(self, request) -> int:
        return request.max_len

    def propose(self, requests, ks: list[int]) -> Proposal:
        """Up to ks[b] drafts for request b (some ks[b] > 0)."""
        raise NotImplementedError

    def features(self, hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor | None:
        return None

    def observe(self, request, features: torch.Tensor | None) -> None:
        """The target's features at the request's newly cached positions (None: the proposer reads
        none, needs_features False)."""

    def rollback(self, request) -> None:
        pass

    def free(self, request) -> None:
        """The request finished or was preempted: release the proposer's state (n-gram's index, the
        oracle's nothing and suffix decoding's stream only depend on tokens, which preemption keeps)."""

    def verified(self, num_draft: list[int], num_accepted: list[int], seconds: float) -> None:
        """The outcome of the step it was last asked to draft for, row by row, and the step's seconds
        (the hybrid learns from them)."""

    def finished(self, request) -> None:
        """The request finished (suffix decoding adds it to its global index)."""

    def twin(self, num_blocks: int) -> "Proposer":
        """This proposer for another engine of num_blocks KV blocks: the same weights, state of its
        own (n-gram keeps all of its state in the requests)."""
        return self


class NgramIndex:
    """Where the most recent occurrence of every n-gram (min_n <= n <= max_n) of a token list was
    followed. Grows with the list: a step costs O(new tokens * (max_n - min_n + 1)) dict updates,
    not a scan of the context."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.follower: dict[tuple[int, ...], int] = {}   # n-gram -> index of the token after it
        self.indexed = 0                                  # n-grams ending before this index are in

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        # An n-gram ending at `end` is indexed once its follower tokens[end] exists, so the
        # suffix itself is never its own match.
        for end in range(max(self.indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.follower[tuple(tokens[end - n:end])] = end
        self.indexed = len(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):   # longest suffix first
            start = self.follower.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer(Proposer):
    """Prompt lookup (Saxena 2023): no model, and very good when the answer copies its context
    (code edits, summaries, extraction). Drafts are one-hot: q(d) = 1."""

    # its drafts are the text after a match: right for a span, however split into steps
    acceptance_in_spans = True
    drafts_on_host = True

    def __init__(self, device: torch.device, min_n: int = 1, max_n: int = 4):
        self.device, self.min_n, self.max_n = device, min_n, max_n

    def propose(self, requests, ks) -> Proposal:
        for req in requests:
            req.proposer_state = req.proposer_state or NgramIndex(self.min_n, self.max_n)
        drafts = [r.proposer_state.lookup(r.tokens, k) if k else [] for r, k in zip(requests, ks)]
        return Proposal([len(d) for d in drafts], drafts)   # one-hot, on the host


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation of each prompt, recorded beforehand by plain
    decoding (continuations: prompt ids -> output ids): at T = 0 every draft is accepted, so it
    measures the ceiling of the speculative machinery (acceptance length K + 1) on any model,
    random weights included. For benchmarks only."""

    drafts_on_host = True

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, requests, ks) -> Proposal:
        drafts = []
        for req, k in zip(requests, ks):
            done = len(req.tokens) - len(req.prompt_ids)
            drafts.append(self.continuations.get(tuple(req.prompt_ids), [])[done:done + k])
        return Proposal([len(d) for d in drafts], drafts)


@dataclass
class Round:
    """A model proposer's round of draft steps, planned on the host before the decode step's upload
    (cuda_graph.StepGraphs runs it)."""
    # the first step's cached counts, lengths, input ids, then batch rows: sent in the step's copy
    host: list[int]
    rows: list[int]                       # the batch rows that draft (K > 0), in the first step's order
    shape: MetadataShape                  # of the first step's metadata at the start of `host`
    first_position: list[int]             # per batch row: the proposer's position for d_1 (0: no round)
    catch_up: list[int]                   # per batch row: the positions its first step feeds (0: no round)
    first_width: int                      # blocks of the longest table in the first step
    width: int                            # blocks of the longest table by the end of the round
    features: torch.Tensor | None = None  # EAGLE: the target features the first step feeds
    device: torch.Tensor | None = None    # `host` on the device, once sent
    # draft steps: the most drafts a row asks of it (a hybrid's suffix rows may verify more)
    k: int = 0
    tree: tuple[int, int] | None = None   # EAGLE-2 trees of (topk, steps) instead of chains (tree.grow_tree)


@dataclass(slots=True)
class CacheState:
    """A request's entries in a proposer's own paged cache."""
    block_table: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0          # positions cached
    num_real: int = 0            # EAGLE: leading positions fed with real target features
    pending: list[torch.Tensor] = field(default_factory=list)   # EAGLE: real features not yet fed
    failed: bool = False         # EAGLE: feeding it without a round (absorb) gave non-finite K/V


def align_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: models sharing a tokenizer may pad their
    embeddings to different sizes; padding ids get no probability."""
    if logits.shape[-1] >= vocab:
        return logits[:, :vocab]
    return F.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))


def draw(logits: torch.Tensor, sampling: SamplingBatch, rows: torch.Tensor, positions: torch.Tensor):
    """The draft's token for each row: argmax when every request is greedy (q one-hot, not
    returned), else a draw from q = the draft's distribution after the request's own T/top-k/top-p."""
    if sampling.greedy:
        return logits.argmax(-1), None
    q = target_probs(logits, sampling.temperature[rows], sampling.top_k[rows], sampling.top_p[rows],
                     sampling.truncate)
    return pick(q, uniform_noise(sampling.seeds[rows], positions, DRAFT)), q


class ModelProposer(Proposer):
    """What the draft model and EAGLE share: a paged cache of their own and a round of K draft steps,
    planned on the host (prepare) and run on the device by cuda_graph.StepGraphs with first_step
    and next_step, no host work between them.

    next_step(meta, input_ids, hidden) -> (logits, hidden): a draft step takes what the step before
    handed it (EAGLE: its hidden states; None for a draft model) and returns its own, writing
    nothing else but its K/V: a graph of the round can run twice (capture's warm-up, then replay)."""

    # A round whose first step feeds at most this many positions per row (a draft model's steady
    # state: 1 after a rejection, 2 when all K were accepted) runs as one graph, catch-up included.
    graphed_catch_up = 0
    shift = 0   # its position i holds what tokens[:i + 1 + shift] make (EAGLE's element i reads t_{i+1})
    tree: tuple[int, int] | None = None   # (topk, steps): it drafts EAGLE-2 trees (tree.grow_tree)
    max_slots = 1 << 62   # the positions its block tables reach (the engine's max_model_len: LLM sets it)

    def round_slots(self, k: int) -> int:
        """The slots a round writes past its catch-up: K - 1 drafts fed, or a tree's frontiers."""
        return self.tree[0] * (self.tree[1] - 1) if self.tree else k - 1

    def __init__(self, kv_cache: KVCache, vocab: int, max_positions: int, device: torch.device):
        # vocab: the ids the engine emits (its drafts are over those); max_positions: its context
        self.kv_cache, self.vocab, self.max_positions, self.device = kv_cache, vocab, max_positions, device

    def state(self, request) -> CacheState:
        if request.proposer_state is None:
            request.proposer_state = CacheState()
        return request.proposer_state

    def tree_roots(self, batch: int) -> list[torch.Tensor]:
        """Buffers of an EAGLE-2 tree's depth 1 (tree.root_children) in every row: scores and tokens
        [batch, topk]."""
        return [torch.zeros(batch, self.tree[0], dtype=dtype, device=self.device)
                for dtype in (torch.float32, torch.long)]

    def max_drafts(self, request) -> int:
        """How many drafts this proposer can make for the request now: positions up to
        len(tokens) + K - 2 are fed, and its position table ends at max_positions. A tree's round
        writes its frontiers' slots past them whatever its K (within its block table, max_slots) and
        has at most as many nodes as grow_tree makes candidates."""
        if self.tree:
            topk, steps = self.tree
            fits = len(request.tokens) + self.round_slots(0) <= min(self.max_positions, self.max_slots)
            return topk + (steps - 1) * topk * topk if fits else 0   # the tree's most nodes
        return max(0, self.max_positions + 1 - len(request.tokens))

    def cached_prefix(self, request, n: int) -> int:
        """A new request's target cache holds its first n positions: take this cache's published
        blocks of the longest prefix of them; returns how many the target may skip (it gives back
        what it found past them): only what this cache holds too. EAGLE feeds the target's features
        from its own length on, and leaves its first round one position whose feature the target
        prefills. A draft model could catch up from the tokens alone, but its pool, as large as the
        target's, would then hold its own copies of blocks the target shares, fill first, and leave
        rows out of rounds (with_room) that a cold engine drafts for: seeded sampling would differ."""
        st, size = self.state(request), self.kv_cache.block_size
        own = min(n, (len(request.tokens) - 1 - self.shift) // size * size)
        st.num_cached = st.num_real = self.kv_cache.allocator.cached_prefix(
            st.block_table, request.tokens[:own + self.shift], self.shift)
        return st.num_cached

    def publish(self, request) -> None:
        """After rollback: its cached positions hold committed inputs, read by the round just run,
        whose logits were finite (a step with non-finite ones fails before this)."""
        st = self.state(request)
        if not st.failed:
            self.kv_cache.allocator.publish(st.block_table, request.tokens, st.num_cached, self.shift)

    def with_room(self, requests, ks) -> list[int]:
        """The rows that draft (K > 0) and whose round's blocks fit in the pool, in order (see the
        top); a row that does not fit drafts nothing this step."""
        allocator, rows = self.kv_cache.allocator, []
        free = allocator.num_free
        for b, k in enumerate(ks):
            if k:
                st = self.state(requests[b])
                need = allocator.blocks_for(st.num_cached + self.catch_up_len(requests[b], st)
                                            + self.round_slots(k)) - len(st.block_table)
                if need <= free:
                    rows.append(b)
                    free -= need
        return rows

    def propose(self, requests, ks) -> Proposal:
        """A round of draft steps for the rows it can draft for (max_drafts) and has room for
        (with_room); the rows left out draft nothing this step."""
        num_draft = [min(k, self.max_drafts(r)) for r, k in zip(requests, ks)]
        plan = self.prepare(requests, num_draft) if max(num_draft) else None
        kept = set(plan.rows) if plan else set()
        tree = (self.tree[1], min(self.tree[0], max(num_draft))) if plan and self.tree else None
        return Proposal([d if b in kept else 0 for b, d in enumerate(num_draft)], round=plan, tree=tree)

    def prepare(self, requests, ks) -> Round | None:
        """Plan a round of draft steps (request b drafts ks[b]) and grow every block it will write,
        before it runs; None when no row fits in the pool (with_room: the rows left out draft
        nothing). Its host data rides in the decode step's one copy; the later steps need none
        (cuda_graph.StepGraphs.round_body)."""
        rows = self.with_room(requests, ks)
        if not rows:
            return None
        states = [self.state(requests[b]) for b in rows]
        inputs, lens, features = self.catch_up([requests[b] for b in rows], states)
        host, shape = pack_metadata(None, [s.num_cached for s in states], lens, inputs)
        allocator = self.kv_cache.allocator
        first_position, catch_up = [0] * len(requests), [0] * len(requests)
        first_width = width = 1
        for b, st, n in zip(rows, states, lens):   # the round feeds n positions, then round_slots
            first_width = max(first_width, allocator.blocks_for(st.num_cached + n))
            allocator.grow(st.block_table, st.num_cached + n + self.round_slots(ks[b]))
            width = max(width, len(st.block_table))
            st.num_cached += n
            first_position[b], catch_up[b] = st.num_cached, n
            if not self.tree:   # (a tree's slots are scratch past the cache: never cached inputs)
                st.num_cached += ks[b] - 1
        return Round(host + rows, rows, shape, first_position, catch_up, first_width, width, features,
                     k=max(ks[b] for b in rows), tree=self.tree)

    def carry(self, batch: int) -> torch.Tensor | None:
        """What a draft step hands the next besides its token (EAGLE: its hidden states), for
        `batch` rows; None for a draft model."""
        return None

    def twin(self, num_blocks: int) -> "ModelProposer":
        twin = copy.copy(self)
        twin.kv_cache = self.kv_cache.empty_like(num_blocks)
        return twin

    def free(self, request) -> None:
        if request.proposer_state is not None:
            self.kv_cache.allocator.release(request.proposer_state.block_table)
        request.proposer_state = None


class DraftModelProposer(ModelProposer):
    """A small model of the same family and tokenizer drafts autoregressively.

    Rollback: the draft fed the committed tokens and d_1 .. d_{K-1}. Its cache stays valid up to
    the first position whose committed token differs from what it fed, i.e. min(its length, the
    request's length - 1). When all K drafts are accepted, d_K (never fed) and the bonus token are
    both new to it: the next catch-up feeds them. A tree round's frontiers go to scratch slots past
    its length (prepare does not count them), so the rollback keeps only what the catch-up fed."""

    graphed_catch_up = 2

    def __init__(self, model, num_blocks: int, block_size: int, vocab: int, device: torch.device):
        cfg = model.config
        dtype = next(model.parameters()).dtype
        super().__init__(KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                 dtype, device), vocab, cfg.max_position_embeddings, device)
        self.model = model

    def catch_up_len(self, request, state) -> int:
        """How many positions its next first step feeds: every token the draft has not cached."""
        return len(request.tokens) - state.num_cached

    def catch_up(self, requests, states):
        """The first step feeds every token the draft has not cached."""
        inputs = [t for r, s in zip(requests, states) for t in r.tokens[s.num_cached:]]
        return inputs, [self.catch_up_len(r, s) for r, s in zip(requests, states)], None

    def first_step(self, meta, plan, rows_t, carry) -> torch.Tensor:
        """The logits after each request's catch-up."""
        return self.catch_up_step(meta, meta.extra, meta.query_start[1:] - 1)

    def catch_up_step(self, meta, input_ids, last) -> torch.Tensor:
        """The logits at flat rows `last` (each request's last fed position)."""
        hidden, _ = self.model(input_ids, meta.rotary_positions, self.kv_cache, meta)
        return self.model.logits(hidden[last])

    def next_step(self, meta, input_ids, hidden):
        return self.catch_up_step(meta, input_ids, meta.query_start[1:] - 1), None

    def rollback(self, request) -> None:
        st = self.state(request)
        st.num_cached = min(st.num_cached, len(request.tokens) - 1)
        self.kv_cache.allocator.truncate(st.block_table, st.num_cached)
        self.publish(request)


# EAGLE: the target's features a request may hold back from the head (then fed without drafting)
ABSORB_AT = 256


class EagleProposer(ModelProposer):
    """Element i of the head's sequence is (target feature f_i, token t_{i+1}) at position i.

    With tokens t_0 .. t_{n-1} and the target's features f_0 .. f_{n-2} (it caches all but the last
    token), the first step feeds the elements with real features the head has not seen, ending with
    (f_{n-2}, t_{n-1}), and reads d_1 from the last output; step i feeds (its own last output, d_{i-1}).
    After verification, only elements with real features stay (rollback to num_real); the
    features of the newly accepted positions arrive through observe()."""

    needs_features = True
    shift = 1

    def __init__(self, head, target, aux_layers, num_blocks: int, block_size: int, vocab: int,
                 device: torch.device):
        cfg = head.config
        dtype = next(head.parameters()).dtype
        super().__init__(KVCache(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device),
                         vocab, cfg.max_position_embeddings, device)
        self.head, self.target = head, target
        # a head's own, else the target's
        self.embed = getattr(head, "embed_tokens", target.model.embed_tokens)
        self.capture_layers = tuple(aux_layers or ())

    def features(self, hidden, captured):
        return torch.cat(captured, dim=-1) if self.capture_layers else hidden

    def observe(self, request, features) -> None:
        """The target's features of the request's newly cached positions, for the head's next round.
        Where no round runs (K = 0, a hybrid's rows that take suffix drafts) they pile up: at
        ABSORB_AT they are fed to the head without drafting (but the last), so that their memory
        stays bounded."""
        st = self.state(request)
        if st.failed:   # its head drafts nothing more (absorb)
            return
        st.pending.append(features)
        if self.catch_up_len(request, st) >= ABSORB_AT:
            self.absorb([request], keep_last=True)

    def finished(self, request) -> None:
        """With prefix caching, a finishing request's held-back features that complete a block of the
        head's cache are fed to it (absorb publishes it): a later turn skips only as much of the
        target's prefill as the head's cache holds (EAGLE needs the target's features past it)."""
        st, size = self.state(request), self.kv_cache.block_size
        if self.kv_cache.allocator.prefix_caching and (
                (st.num_real + self.catch_up_len(request, st)) // size > st.num_real // size):
            self.absorb([request])

    def max_drafts(self, request) -> int:
        """None before the target has given a feature to start from: a one-token prompt before its
        first step (the target caches all but the last token, so has computed no feature yet)."""
        st = self.state(request)
        fed = st.num_real or any(len(f) for f in st.pending)
        return super().max_drafts(request) if fed and not st.failed else 0

    def catch_up_len(self, request, state) -> int:
        """How many elements its next first step feeds: those with real features not fed yet."""
        return sum(len(f) for f in state.pending)

    def catch_up(self, requests, states, keep_last: bool = False):
        """The first step feeds the elements with real features the head has not seen (element i
        is (f_i, t_{i+1}): as many tokens as features), but for each request's last with keep_last
        (absorb's: a round's first step must feed one, whose output gives d_1)."""
        lens = [self.catch_up_len(r, s) - keep_last for r, s in zip(requests, states)]
        token_ids = [t for r, s, n in zip(requests, states,
                                          lens) for t in r.tokens[s.num_real + 1:s.num_real + 1 + n]]
        fed = [s.pending[:-1] + [s.pending[-1][:-1]] if keep_last else s.pending for s in states]
        features = torch.cat([f for parts in fed for f in parts])
        for s, n in zip(states, lens):
            s.pending, s.num_real = [s.pending[-1][-1:]] if keep_last else [], s.num_real + n
        return token_ids, lens, features

    @torch.inference_mode()
    def absorb(self, requests, keep_last: bool = False) -> None:
        """Feed each request's held-back elements (but its last, with keep_last) to the head without
        drafting: a round's catch-up alone, one eager pass of the head (observe, finished). No logits
        tell whether its K/V are finite: one read of the blocks it wrote and one sync do, as after a
        target's prefill chunk. Finite, they are published; not (a broken head), they are zeroed, so
        that no slot a request may read holds a non-finite value it did not write (kv_cache.py), and
        the request's head drafts and publishes nothing more (a round would fail it; here no logits
        can). A row the pool has no room for keeps its features."""
        allocator, rows, free = self.kv_cache.allocator, [], self.kv_cache.allocator.num_free
        for request in requests:
            self.rollback(request)   # past its real elements: the drafts of its last round
            st = self.state(request)
            n = self.catch_up_len(request, st) - keep_last
            need = allocator.blocks_for(st.num_cached + n) - len(st.block_table)
            if n > 0 and need <= free:
                rows.append(request)
                free -= need
        if not rows:
            return
        states = [self.state(r) for r in rows]
        cached = [s.num_cached for s in states]
        token_ids, lens, features = self.catch_up(rows, states, keep_last)
        for st, n in zip(states, lens):
            allocator.grow(st.block_table, st.num_cached + n)
        meta = build_metadata([s.block_table for s in states], cached, lens, self.kv_cache.block_size,
                              self.device, extra=token_ids)
        self.forward(meta, meta.extra, features)
        for request, st, c in zip(rows, states, cached):
            st.num_cached = st.num_real
            written = st.block_table[c // self.kv_cache.block_size:]   # (a block is shared only once full)
            if not bool(torch.isfinite(self.kv_cache.pool[:, :, written]).all()):
                self.kv_cache.zero_blocks(written)
                st.failed = True
            self.publish(request)

    def carry(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, self.head.config.hidden_size, dtype=next(self.head.parameters()).dtype,
                           device=self.device)

    def first_step(self, meta, plan, rows_t, carry) -> torch.Tensor:
        """The logits after each request's catch-up; its hidden states go to carry[rows_t]."""
        hidden = self.forward(meta, meta.extra, plan.features)
        carry[rows_t] = self.head.carried(hidden)
        return self.head.logits(hidden, self.target)

    def next_step(self, meta, input_ids, hidden):
        hidden = self.forward(meta, input_ids, hidden)
        return self.head.logits(hidden, self.target), self.head.carried(hidden)

    def forward(self, meta, token_ids, features) -> torch.Tensor:
        embeds = self.embed(token_ids)
        hidden = self.head(embeds, features, meta.rotary_positions, self.kv_cache, meta)
        return hidden[meta.query_start[1:] - 1]

    def rollback(self, request) -> None:
        st = self.state(request)
        st.num_cached = st.num_real
        self.kv_cache.allocator.truncate(st.block_table, st.num_cached)
        self.publish(request)
