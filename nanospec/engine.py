"""The continuous-batching scheduler and the step loop (a request's record: request.py).

A step is: schedule (prefill chunks, or a decode step for every running request), then for a decode
step ask the proposer for one Proposal (up to K drafts per request, made on the host or in a round
on the device: the engine treats both alike; the K policy may keep fewer, `trim`), verify them in
one target forward and rejection-sample (cuda_graph.py, sampler.py), commit the accepted tokens and
settle (roll the KV length back in target and proposer to what was accepted). With no proposer a
decode step is plain decoding (K = 0).
Invariants of a running request:
- every token but the last is in the KV cache once its prefill is done (num_cached == len(tokens) - 1),
  and every output token is emitted by a decode step (the first one too);
- a preempted request loses its cache (num_cached = 0) and recomputes it from its tokens, then
  resumes with the same decode step it would have run; with counter-based noise (sampler.py) its
  output does not depend on preemption or on the other requests in its batch (with drafts, a
  seeded sample depends on the K each of its steps took: Engine.num_drafts).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from dataclasses import dataclass

import torch

from nanospec.errors import NonFiniteLogits, non_finite_error
from nanospec.k_policy import KPolicy, StaticK
from nanospec.cuda_graph import StepGraphs, StepOptions, Verified
from nanospec.kv_cache import BlockAllocator, KVCache, build_metadata, pack_metadata
from nanospec.proposer import Proposal, Proposer
from nanospec.request import Request, emittable_vocab, end_of, new_request, note_logprobs, own_cap
from nanospec.sampler import Sampler
from nanospec.sampling_params import SamplingParams
from nanospec.stats import Stats, accepted_positions, note_speculation
from nanospec.tree import follow_paths


@dataclass
class Batch:
    requests: list[Request]
    query_lens: list[int]         # new tokens per request in this forward pass
    is_prefill: bool
    chunk: Batch | None = None    # a decode step's prefill chunks, in its forward (a mixed step)


class Scheduler:
    """Continuous batching: admit waiting requests while blocks allow, prefill in chunks under a
    token budget, and when decode runs out of blocks preempt the newest request (free, recompute).

    decode_between_prefills (the server's default): after a prefill chunk, a decode step for the
    requests already decoding, so that a long prompt arriving does not stall the running streams for
    all its chunks; offline, every prefill goes first (the largest decode batches). A request yet to
    give a token joins those steps only once no prompt is left to prefill: its stream then starts
    after the chunks instead of having them as gaps.
    mixed_prefill_tokens (the server's --mixed-prefill-tokens, with decode_between_prefills; 0: off):
    a decode step carries up to that many prompt tokens of prefill chunks in its forward (a mixed
    step, as vLLM and SGLang schedule), so an arrival's prefill is spread over the running streams'
    steps instead of stalling them; a prefill-only step (nothing decoding) takes the whole
    max_num_batched_tokens."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 on_free=None, decode_between_prefills: bool = False, cached_prefix=None):
        self.allocator = allocator
        self.stats = Stats()   # it counts preemptions and prefix-cache lookups there (Engine.stats)
        self.on_free = on_free or (lambda request: None)   # the proposer releases its state too
        # a waiting request's cached positions: the prefix cache's (engine.cached_prefix: the proposer's too)
        self.cached_prefix = cached_prefix or (
            lambda req: allocator.cached_prefix(req.block_table, req.tokens[:-1]))
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_between_prefills = decode_between_prefills
        self.mixed_prefill_tokens, self.last_was_prefill = 0, False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_drafts=lambda request: 0) -> Batch:
        """Prefill chunks if any request needs one, else a decode step in which request r verifies
        num_drafts(r) draft tokens after its last one (so it needs num_drafts(r) + 1 new slots);
        with decode_between_prefills, a decode step first after each prefill chunk (or, with
        mixed_prefill_tokens, a decode step with chunks in it)."""
        mixed = self.mixed_prefill_tokens
        while True:
            # After a prefill chunk (with mixed steps, always) a decode step first, for the streams.
            # Unmixed, a request yet to stream waits while prompts are still to prefill: each chunk
            # after its first token would be a gap in its stream. (Decode all after the prefill: it
            # may admit requests with nothing to prefill, which decode now.)
            decode_first = self.decode_between_prefills and (self.last_was_prefill or mixed)
            hold = decode_first and not mixed and (self.waiting or any(r.in_prefill for r in self.running))
            batch = ((decode_first and self._schedule_decode(num_drafts, streams_only=bool(hold)))
                     or self._schedule_prefill() or self._schedule_decode(num_drafts))
            if decode_first and mixed and batch and not batch.is_prefill:
                batch.chunk = self._schedule_prefill(mixed)   # chunks ride in it
            if batch:
                self.last_was_prefill = batch.is_prefill
                return batch
            self.preempt(self.running[-1])   # every running request is stuck in prefill: make room

    def _schedule_prefill(self, budget: int | None = None) -> Batch | None:
        budget, chosen, lens = budget or self.max_num_batched_tokens, [], []
        candidates = [(r, False) for r in self.running if r.in_prefill] + [(r, True) for r in self.waiting]
        for req, is_waiting in candidates:
            if budget == 0 or (is_waiting and len(self.running) >= self.max_num_seqs):
                break
            if is_waiting:   # with prefix caching its cache may begin with published blocks
                req.num_cached = self.cached_prefix(req)
            # Prefill caches every token but the last; the last is the input of the first decode step.
            chunk = min(len(req.tokens) - 1 - req.num_cached, budget)
            if not self.allocator.can_grow(req.block_table, req.num_cached + chunk):
                if is_waiting:   # it waits on, holding nothing
                    self.allocator.release(req.block_table)
                    self.on_free(req)
                    req.num_cached = 0
                break
            self.allocator.grow(req.block_table, req.num_cached + chunk)
            if is_waiting:
                self.waiting.popleft()
                self.running.append(req)
                self.stats.prefix_cache_queries += len(req.tokens) - 1
                self.stats.prefix_cache_hits += req.num_cached
            if chunk:   # (a one-token prompt has nothing to prefill)
                chosen.append(req)
                lens.append(chunk)
                budget -= chunk
        return Batch(chosen, lens, is_prefill=True) if chosen else None

    def _schedule_decode(self, num_drafts, streams_only: bool = False) -> Batch | None:
        # Preemption takes the newest request, so running only loses its tail here: the i-th request
        # of the loop is still running while i < len(self.running).
        chosen, lens = [], []
        for i, req in enumerate(list(self.running)):
            if i >= len(self.running):   # preempted, and every request after it
                break
            if req.in_prefill or streams_only and not req.output_ids:
                continue
            num_new = num_drafts(req) + 1
            while i < len(self.running) and not self.allocator.can_grow(req.block_table,
                                                                        req.num_cached + num_new):
                self.preempt(self.running[-1])   # the newest: req itself when it is the last
            if i < len(self.running):
                self.allocator.grow(req.block_table, req.num_cached + num_new)
                chosen.append(req)
                lens.append(num_new)
        return Batch(chosen, lens, is_prefill=False) if chosen else None

    def preempt(self, req: Request) -> None:
        self.remove([req])   # freed as a finished request is, then back to the front of the queue
        req.num_cached = 0
        self.waiting.appendleft(req)
        self.stats.preemptions += 1

    def remove(self, requests: list[Request]) -> None:
        """Take requests out wherever they are (waiting, running or finished) and free their blocks
        and proposer state: a finished or preempted request, and what a failed or interrupted call
        leaves behind. Found by identity (`in` would compare every Request's fields, token lists
        included)."""
        gone = {id(r) for r in requests}
        self.running[:] = [r for r in self.running if id(r) not in gone]
        self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for req in requests:
            self.allocator.release(req.block_table)   # idempotent: a finished request holds none
            self.on_free(req)


def cached_prefix(allocator: BlockAllocator, proposer: Proposer | None, req: Request) -> int:
    """A new request's positions found in the prefix cache: the target's, cut where a model
    proposer needs the target to compute more (EAGLE: the features past what its own cache holds);
    the target gives back the blocks past them."""
    found = allocator.cached_prefix(req.block_table, req.tokens[:-1])
    if found and hasattr(proposer, "cached_prefix"):
        found = proposer.cached_prefix(req, found)
        allocator.truncate(req.block_table, found)
    return found


def release(step_graphs: StepGraphs, proposer: Proposer | None, req: Request) -> None:
    """A request left the running batch (finished, preempted, removed): release its device table
    rows and its proposer state."""
    step_graphs.tables.release(req.block_table)
    if proposer:
        if step_graphs.draft_tables and req.proposer_state is not None:
            step_graphs.draft_tables.release(req.proposer_state.block_table)
        proposer.free(req)


def chunk_rows(batch: Batch) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """A batch of prefill chunks as kv_cache.pack_metadata and build_metadata take it: block tables,
    cached counts, lengths, then the chunks' token ids (`extra`: they ride in the one copy)."""
    reqs, lens = batch.requests, batch.query_lens
    ids = [t for r, n in zip(reqs, lens) for t in r.tokens[r.num_cached:r.num_cached + n]]
    return [r.block_table for r in reqs], [r.num_cached for r in reqs], lens, ids


class Engine:
    """Owns the model, its KV cache, the scheduler, the sampler and the proposer; `step` advances every
    request.

    K per decode step comes from the KPolicy it is built with (k_policy.py: static K, the queue-size
    switch-off; dynamic_k.py: dynamic K and the budget): a K per request, never more than the
    request can still emit; the step verifies up to the largest. Without a proposer every step is
    plain decoding."""

    def __init__(self, model, tokenizer, device: torch.device, max_model_len: int, num_kv_blocks: int,
                 block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 compile_sampler: bool | None = None, proposer: Proposer | None = None,
                 k_policy: KPolicy | None = None, use_graphs: bool = False, prefix_caching: bool = False,
                 step_options: StepOptions | None = None):
        """step_options: how eager steps run and the CPU's attention (cuda_graph.StepOptions; None:
        its defaults)."""
        cfg = model.config
        self.step_options = options = step_options or StepOptions()
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_model_len = max_model_len
        self.proposer, self.k_policy = proposer, k_policy or StaticK(0)
        if hasattr(proposer, "kv_cache"):   # a model proposer's own cache: as the target's
            proposer.kv_cache.allocator.prefix_caching = prefix_caching
            proposer.kv_cache.use_mirror = options.kv_mirror
        self.kv_cache = KVCache(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                next(model.parameters()).dtype, device, prefix_caching, options.kv_mirror)
        self.use_graphs = use_graphs
        self.sampler = Sampler(compile=device.type == "cuda" if compile_sampler is None else compile_sampler)
        self.eos_ids = set(cfg.eos_token_ids) | set(tokenizer.eos_ids)
        # The ids a request may hold: the model has logits for them and the tokenizer decodes them.
        # An embedding padded past the tokenizer (Qwen: 151,936 rows, 151,665 tokens) never emits
        # its padding: the logits are cut to this size before sampling.
        self.vocab_size = emittable_vocab(cfg, tokenizer)
        self.step_graphs = StepGraphs(model, self.kv_cache, self.vocab_size, max_num_seqs, max_model_len,
                                      device, self.sampler, proposer, use_graphs, options)
        # on_free is not a bound method of the engine: a scheduler holding the engine would make a
        # reference cycle, and a dead engine's graphs and KV cache would wait for the garbage collector.
        self.scheduler = Scheduler(self.kv_cache.allocator, max_num_seqs, max_num_batched_tokens,
                                   on_free=functools.partial(release, self.step_graphs, proposer),
                                   cached_prefix=functools.partial(cached_prefix, self.kv_cache.allocator,
                                                                   proposer))
        self.stats = self.scheduler.stats   # (LLM.generate replaces both with a new one per call)
        self.max_k = 0           # the largest K a request may ask for (the LLM sets it: its graphs' K)
        self.step_k = 0          # the current decode step's K (the largest of its requests')
        self.request_k = {}      # id(request) -> its K in the current decode step

    def add_requests(self, requests: list[Request]) -> None:
        """Queue requests made by new_request (the one way work enters the engine)."""
        self.scheduler.waiting.extend(requests)

    def abort(self, requests: list[Request]) -> None:
        """Drop requests, wherever they are, with their blocks and proposer state: after a failed or
        interrupted run the engine is as if they had never been queued."""
        self.scheduler.remove(requests)
        for req in requests:
            self.k_policy.forget(req)

    def new_request(self, index: int, prompt: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A request checked against this engine (request.new_request); add_requests queues it."""
        allocator = self.kv_cache.allocator
        return new_request(index, prompt, prompt_ids, params, self.vocab_size, self.max_model_len,
                           allocator.num_blocks * allocator.block_size, self.max_k, self.proposer is not None)

    def choose_ks(self) -> None:
        """Ask the K policy for the next decode step's K per request (its batch: the running
        requests past their prefill); 0 without a proposer."""
        decoding = [r for r in self.scheduler.running if not r.in_prefill]
        if not self.proposer or not decoding:
            self.step_k, self.request_k = 0, {}
            return
        ks = self.k_policy.choose(decoding, len(self.scheduler.waiting) + len(self.scheduler.running))
        ks = [own_cap(r, k) for r, k in zip(decoding, ks)]
        self.step_k, self.request_k = max(ks), {id(r): k for r, k in zip(decoding, ks)}

    def num_drafts(self, req: Request) -> int:
        """K for this request: never more than it can still emit (K accepted + 1 bonus <= what is left).
        A request admitted by this step's scheduling with nothing to prefill (a one-token prompt, a
        prompt the prefix cache holds) decodes in this very step, which choose_ks did not see coming:
        the policy chooses again, with it. Else its first step would take the batch's K, 0 where no
        other request decodes, and a seeded sample would depend on the cache and the batch (a
        draft's step draws other noise than a plain one)."""
        if self.proposer and id(req) not in self.request_k:
            self.choose_ks()
        return max(0, min(own_cap(req, self.request_k.get(id(req), self.step_k)),
                          req.max_len - len(req.tokens) - 1))

    def step(self) -> list[Request]:
        """One scheduled step: a prefill pass, or a decode step (propose, verify, commit); returns the
        requests that got new tokens (none, and no pass, when nothing is queued or running)."""
        if not self.scheduler.has_work():
            return []
        self.choose_ks()
        batch = self.scheduler.schedule(self.num_drafts)
        run = self.run_prefill if batch.is_prefill else self.run_verify
        try:
            results = run(batch)   # [(request, new tokens, features of its newly cached positions)]
        except NonFiniteLogits as e:
            return self.fail(e.failed)
        except BaseException:   # an error, or Ctrl-C, midway: the pass may have written part of its K/V
            # (a device failed for good: its own error is the one raised)
            with contextlib.suppress(Exception):
                self.clear_caches()
            raise
        for req, tokens, features in results:
            self.commit(req, tokens, features)
            if req.finish_reason is None:
                self.settle(req, features)
                if tokens:   # (a prefill chunk has published its blocks already)
                    self.publish(req)
        return [req for req, tokens, _ in results if tokens]

    @torch.inference_mode()
    def run_prefill(self, batch: Batch):
        """Cache a chunk of each request's tokens, eagerly (its shapes vary too much for a graph).
        Prefill emits nothing: every token comes out of a decode step, so a preempted request that
        recomputes its cache resumes exactly where it was."""
        tables, cached, lens, ids = chunk_rows(batch)
        meta = build_metadata(tables, cached, lens, self.kv_cache.block_size, self.device, extra=ids)
        capture = self.proposer.capture_layers if self.proposer else ()
        hidden, captured = self.model(meta.extra, meta.positions, self.kv_cache, meta, capture)
        needs_features = self.proposer and self.proposer.needs_features   # EAGLE reads the target's
        return self.prefilled(batch, self.proposer.features(hidden, captured) if needs_features else None)

    def prefilled(self, batch: Batch, features: torch.Tensor | None = None):
        """After the forward that cached a batch of prefill chunks (its own, or a mixed step's): count
        them cached and check their K/V finite (a prefill has no logits to tell; one read of the
        blocks they wrote, one sync), then, with prefix caching, publish the full blocks they
        completed, so that requests admitted after them find them. A request whose chunk wrote NaN /
        inf fails now (NonFiniteLogits: the caches are cleared), not at its first decode step: left
        until then, its blocks would go back to the pool with their NaN if it were preempted or
        aborted first, and a request given them would read those slots masked (0 * NaN is NaN).
        Returns each request's results (its features' rows, for EAGLE)."""
        reqs, lens, size = batch.requests, batch.query_lens, self.kv_cache.block_size
        written = [r.block_table[r.num_cached // size:-(-(r.num_cached + n) // size)]   # the chunks' blocks
                   for r, n in zip(reqs, lens)]
        for req, n in zip(reqs, lens):
            req.num_cached += n
        finite = lambda blocks: bool(torch.isfinite(self.kv_cache.pool[:, :, blocks]).all())   # noqa: E731
        if not finite([b for bs in written for b in bs]):
            raise NonFiniteLogits([(r, non_finite_error(r, 1, self.proposer, "K/V"))
                                   for r, bs in zip(reqs, written) if not finite(bs)])
        for req in reqs:   # (without prefix caching, publishing is nothing)
            self.publish(req)
        self.stats.prefill_steps += 1
        rows = [None] * len(reqs) if features is None else features.split(lens)
        return [(r, [], f) for r, f in zip(reqs, rows)]

    @torch.inference_mode()
    def run_verify(self, batch: Batch):
        """The speculative step: propose, verify [last token, d_1 .. d_k] per request in one target
        forward, rejection-sample. With no proposer (or K = 0) this is plain decoding. It runs on
        the static buffers of cuda_graph.py (a graph replay on CUDA): one copy in, which carries
        the whole step's host data (n-gram's drafts too), and one copy back of tokens, accepted
        counts and finiteness flags (and a second, of logprobs, when a request asked for them). A
        draft tree (tree.py) is verified alike, its accepted path then moved in place (follow_paths)."""
        start = time.perf_counter()
        # a decode row's query_lens is its K + 1 (Scheduler._schedule_decode grew its blocks for them)
        reqs, asked = batch.requests, [n - 1 for n in batch.query_lens]
        proposal = self.proposer.propose(reqs, asked) if max(asked) else Proposal([0] * len(reqs))
        ks, proposal = self.k_policy.trim(reqs, asked, proposal)   # the drafts worth verifying (a budget's)
        # A mixed step's prefill chunks ride in the verify's forward; beside a tree (its mask covers
        # the decode rows) or for EAGLE (it reads the chunks' features) they take a pass of their own.
        chunk, prefilled = batch.chunk, []
        if chunk and (proposal.tree is not None or (self.proposer and self.proposer.needs_features)):
            chunk, prefilled = None, self.run_prefill(chunk)
        steps = self.step_graphs
        steps.upload(reqs, proposal.num_draft, proposal.host_drafts, proposal.round, proposal.parents,
                     proposal.tree, chunk and pack_metadata(*chunk_rows(chunk)))
        if proposal.round:   # a model proposer's draft steps, on the device
            steps.run_round(proposal.round)
        out, features, logits = steps.run()
        rows = Verified.rows(out[:len(reqs)], tree=proposal.tree is not None)   # the one copy back
        if any(v.non_finite for v in rows):
            raise NonFiniteLogits([(r, non_finite_error(r, v.non_finite, self.proposer))
                                   for r, v in zip(reqs, rows) if v.non_finite])
        q_len = max(proposal.num_draft) + 1
        if features is not None:   # out of the graph's output before the next replay overwrites it
            features = features[:len(reqs) * q_len].clone()
        paths = None if proposal.tree is None else [v.path for v in rows]
        if paths:   # the accepted paths' K/V down to the slots after the last token
            logits, features = follow_paths(self.kv_cache, reqs, paths, logits, features, q_len)
        if logits is not None:   # a request asked for logprobs: a second copy back
            note_logprobs(reqs, [v.emitted for v in rows], logits)
        self.account(reqs, ks, proposal.num_draft, [v.accepted for v in rows], start, paths, max(asked) > 0)
        if chunk:
            prefilled = self.prefilled(chunk)
        # The target keeps the positions of its last token and the accepted drafts: a + 1 of them.
        return [(r, v.emitted, None if features is None else features[b * q_len:b * q_len + v.accepted + 1])
                for b, (r, v) in enumerate(zip(reqs, rows))] + prefilled

    def account(self, reqs: list[Request], ks: list[int], num_draft: list[int], accepted: list[int],
                start: float, paths: list[list[int]] | None = None, proposed: bool = True) -> None:
        """Count a verified step: each request's cached positions and its speculation, the engine's
        stats; the proposer (if it proposed: every propose is followed by its outcome, a budget that
        kept none of its drafts too) and the K policy learn from its outcome (a tree's: the accepted
        paths) and its time (taken after the one copy back, so the device's work is in it)."""
        for req, d, positions in zip(reqs, num_draft, accepted_positions(accepted, paths)):
            req.num_cached += d + 1   # every slot the verify wrote; settle cuts back to the committed
            req.decode_steps += 1
            if d:
                note_speculation(req, d, positions)
        self.stats.record(self.step_k, ks, num_draft, accepted, paths)
        seconds = time.perf_counter() - start
        if proposed:
            self.proposer.verified(num_draft, accepted, seconds)
        self.k_policy.observe(ks, accepted, num_draft, seconds=seconds, requests=reqs, paths=paths)

    def fail(self, failed: list[tuple[Request, str]]) -> list[Request]:
        """Requests whose own logits were not finite fail alone (finish_reason "error", their error
        set) and leave; the step wrote their NaN / inf K/V, so the caches are cleared and every
        other running request recomputes its own (its output does not change: see the top)."""
        self.clear_caches()
        failed_reqs = [r for r, _ in failed]
        for req in reversed(self.scheduler.running):   # reversed: they wait again in their order
            if not any(req is r for r in failed_reqs):
                self.scheduler.preempt(req)
        for req, message in failed:
            req.finish_reason, req.error, req.text = "error", message, ""
        self.abort(failed_reqs)
        return failed_reqs

    def clear_caches(self) -> None:
        """Zero the target's and a model proposer's pools (their prefix caches and the CPU's K/V mirror
        go with them): after a step whose K/V were not finite (fail), or one that raised midway, which
        may have written some layers' K/V and not others' (layer by layer on CUDA and in the reference
        attention, all at the end in the CPU's mirror) to blocks now free: a later request must find
        neither NaN (a masked key weighs 0, and 0 * NaN is NaN) nor anything but zeros where it did
        not write."""
        self.kv_cache.clear()
        if isinstance(getattr(self.proposer, "kv_cache", None), KVCache):
            self.proposer.kv_cache.clear()

    def commit(self, req: Request, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Append new tokens one by one; the first that ends the request (EOS, a stop string, its
        length) ends it, and whatever was accepted after it is dropped. features: the target's at the
        positions the step fed (its last token and accepted drafts); a finishing request hands its
        proposer those of the tokens it kept (EAGLE: the head's cache, published, ends there)."""
        for i, token in enumerate(tokens):
            req.tokens.append(token)
            if req.logprobs is not None:
                req.logprobs.append(req.step_logprobs[i])
            self.stats.generated_tokens += 1
            end = end_of(req, token, self.eos_ids, self.tokenizer)
            if end:
                return self.finish(req, *end, features=None if features is None else features[:i + 1])

    def settle(self, req: Request, features: torch.Tensor | None) -> None:
        """After commit: roll the KV length back to the committed tokens (every token but the last is
        cached), free blocks past it, and bring the proposer's own state in line."""
        req.num_cached = min(req.num_cached, len(req.tokens) - 1)
        self.kv_cache.allocator.truncate(req.block_table, req.num_cached)
        if self.proposer:
            self.proposer.observe(req, features)
            self.proposer.rollback(req)

    def publish(self, req: Request) -> None:
        """With prefix caching: publish the request's full blocks of committed tokens, after a decode
        step that read them all and gave finite logits (kv_cache.py's invariants): its cached
        positions, up to the last committed token, which is never cached."""
        self.kv_cache.allocator.publish(req.block_table, req.tokens, min(req.num_cached, len(req.tokens) - 1))

    def finish(self, req: Request, reason: str, drop_last: bool = False,
               features: torch.Tensor | None = None) -> None:
        req.finish_reason = reason
        if self.proposer:
            self.proposer.observe(req, features)
            self.proposer.finished(req)
        if req.text is None:   # a stop string already set it ("" included)
            ids = req.output_ids[:-1] if drop_last else req.output_ids
            req.text = self.tokenizer.output_text(ids, req.params.skip_special_tokens)
        self.publish(req)   # every finish follows a decode step (prefill emits no token)
        self.scheduler.remove([req])
        self.k_policy.forget(req)

    def run_to_completion(self, on_step=None) -> None:
        start = time.perf_counter()
        while self.scheduler.has_work():
            updated = self.step()
            if on_step:
                on_step(updated)
        self.stats.elapsed_s += time.perf_counter() - start
