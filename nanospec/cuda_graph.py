"""The decode step in the GPU's shape: static buffers per (batch bucket, K), captured as CUDA graphs
and replayed on CUDA; on CPU, and with enforce_eager, the same bodies run eagerly on the same
buffers, so every CPU test runs the padded, bucketed step that a GPU replays.

A decode step is, in order:
  upload   one int64 buffer from the host, one copy (pinned, non-blocking on CUDA):
             FIELDS rows of `bucket` values, one per batch row (see FIELDS below);
             [bucket, K] drafts made on the host (n-gram; zeros for the others);
             the block-table entries changed since the last step (target's and proposer's):
             (flat index, block id) pairs, written into the device tables right after the copy;
             a model proposer's first draft step (its catch-up): lengths and input ids.
  round    a draft model's or EAGLE head's K draft steps: the first (catch-up: each request feeds
           what the proposer has not seen, a varying length) eagerly, then steps 2..K as one graph
           whose positions advance on the device; drafts, draft probabilities and a finiteness
           flag land in static buffers. A draft model's steady-state round (a catch-up of 1 or 2
           positions per row, padded to 2) is one graph, its first step included.
  verify   the target over [last token, d_1 .. d_K] for every row, acceptance and sampling, as
           one graph; it returns one [bucket, K + 3] int64 tensor: each row's K + 1 tokens, its
           accepted count, and a flag for non-finite logits (1: the target's, 2: the drafter's),
           which the engine reads back in its one copy. A step with a request that asks for
           logprobs, penalties or min_p replays the forward alone as a graph and runs the rest
           (LM head, processing, sampling) eagerly: its host data go in one more copy, and with
           logprobs it also returns its logits, read back in a second copy (see replay).

Padding keeps the step lossless:
- a bucket's rows past the batch are requests of one token at position 0 whose block-table rows are
  null rows (every entry the null block, which the allocator never hands out). They read only
  the null block (zero: nothing writes it), write only the sink block (no table holds it), and
  nothing reads their output.
- a request with fewer drafts than the step's K repeats its last real query in the padded
  positions (the same position, so the same keys), writes their K/V to the sink block (it may own
  no block there), and its logits rows there are replaced by its last real one before sampling.
  In the draft round, a request past its own K drafts on (position 0, writes to the sink block).
  So a request's non-finite K/V stay in its own blocks: no other request reads them, even masked.
- every draft id in the static buffer, stale or padding, is a token id, so the embedding can read it.

On CUDA the graphs share one memory pool, are captured at start for greedy steps (largest bucket
first) and on first use for the others; batches above MAX_GRAPH_BATCH run the bodies eagerly. A
body reads block tables at their full width under a graph and at the batch's widest table when
eager (the same values; only the padding is shorter).

Every body is safe to run twice on the same buffers (capture runs it once to warm up on the
current step's inputs, then replay runs it again): nothing a body reads is written by it, except
values it writes the same way every time (its K/V, drafts[:, i] from drafts[:, i - 1], a flag it
only clears). REHEARSE_GRAPHS makes an eager step run so (twice, at full width), and the tests
compare that with the plain eager step. Capture and every step run under inference mode.
"""
from __future__ import annotations

import numpy as np
import torch

from nanospec.kv_cache import (NULL_BLOCK, SINK_BLOCK, AttentionMetadata, BlockTable, KVCache, decode_metadata,
                               derive_metadata, padding_to_sink, ragged_metadata, upload)
from nanospec.proposer import Round, align_vocab, draw
from nanospec.sampler import SamplingBatch, Truncation, min_p_mask, penalize, prompt_mask

# Per batch row: the target's block-table row, its cached tokens (the last token's position), its
# drafts, its last token, seed, top_k, temperature and top_p (the bits of their float64 values),
# the proposer's block-table row, the proposer's position for d_1, the token before the last, and
# the positions the proposer's first step feeds (its catch-up; 0: the row drafts nothing).
FIELDS = 12
MAX_GRAPH_BATCH = 256   # larger batches run the same bodies eagerly
ONE_BITS = int(np.array(1.0).view(np.int64))


# Eager steps pad their batch to the graphs' buckets, and every row of a verify step to K + 1 queries,
# only when this is set (the tests set it, so that every CPU test runs the padded step a GPU replays):
# on a CPU the padding rows cost what real rows cost (a batch of 9 padded to 16 decoded SmolLM2 about
# 25% slower; docs/performance.md), and so do the queries of drafts n-gram did not find.
PAD_EAGER_BATCHES = False

# An eager step runs each graph body as capture and replay would: twice, at the tables' full width
# (the tests set it, to show that replaying a graph computes what the eager step computes).
REHEARSE_GRAPHS = False


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then every 8 up to 64 and every 16 after, up to the
    first that holds max_batch."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return sizes


def step_buckets(max_batch: int, graphs: bool) -> list[int]:
    """The batch sizes an engine's steps run at: the graphs' buckets, or every size where no graph
    is replayed (CPU, enforce_eager) unless PAD_EAGER_BATCHES."""
    return batch_buckets(max_batch) if graphs or PAD_EAGER_BATCHES else list(range(1, max_batch + 1))


def table_width(cache: KVCache, max_model_len: int) -> int:
    """A table holds at most the blocks of max_model_len, or of the whole pool."""
    return min(cache.allocator.blocks_for(max_model_len), cache.allocator.num_blocks)


class DeviceBlockTables:
    """The block tables of one KV cache's running requests on the device, one row per request (and
    a null row), in flat[base:]; kept current by the updates each step sends: only the ids a
    BlockTable has gained since it was last synced."""

    def __init__(self, flat: torch.Tensor, base: int, num_rows: int, width: int):
        self.base, self.width, self.null_row = base, width, num_rows
        self.tables = flat[base:base + (num_rows + 1) * width].view(num_rows + 1, width)
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.row_len = [0] * num_rows   # per row: the ids past it on the device are the null block

    def updates(self, tables: list[BlockTable]) -> tuple[list[int], list[int]]:
        """Each table's row (assigned on first use) and the (index into flat, id) pairs to write:
        the ids it gained, and the null block over any id past its end (of its own blocks freed by
        a rollback, or of the row's earlier owner), so that a row reaches no other sequence's
        blocks, not even masked (kv_cache.py's invariants)."""
        rows, pairs = [], []
        for table in tables:
            if table.row is None:
                table.row = self.free_rows.pop()
            rows.append(table.row)
            start = self.base + table.row * self.width
            for j in range(table.synced, len(table)):
                pairs += (start + j, table[j])
            for j in range(len(table), self.row_len[table.row]):
                pairs += (start + j, NULL_BLOCK)
            table.synced = self.row_len[table.row] = len(table)
        return rows, pairs

    def release(self, table: BlockTable) -> None:
        if table.row is not None:
            self.free_rows.append(table.row)
            table.row, table.synced = None, 0


class StepGraphs:
    """The decode step on static buffers (see the module's docstring): `upload`, then `run_round`
    for a model proposer's round, then `run` for the verification."""

    def __init__(self, model, kv_cache: KVCache, vocab: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, sampler, proposer=None, use_graphs: bool = False):
        self.model, self.kv_cache, self.vocab, self.device, self.sampler = model, kv_cache, vocab, device, sampler
        self.proposer = proposer
        self.buckets = step_buckets(max_num_seqs, use_graphs and device.type == "cuda")
        draft_cache = getattr(proposer, "kv_cache", None)
        widths = [table_width(kv_cache, max_model_len), table_width(draft_cache, max_model_len) if draft_cache else 0]
        self.flat_tables = torch.full(((max_num_seqs + 1) * sum(widths),), NULL_BLOCK, dtype=torch.int64, device=device)
        self.tables = DeviceBlockTables(self.flat_tables, 0, max_num_seqs, widths[0])
        self.draft_tables = DeviceBlockTables(self.flat_tables, (max_num_seqs + 1) * widths[0], max_num_seqs,
                                              widths[1]) if draft_cache else None
        self.row_width = sum(widths)   # table entries per request, target's and proposer's
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs = {}   # key -> (graph, its output tensors)
        self.inputs = self.host = self.drafts = self.draft_probs = None
        largest = self.buckets[-1]
        self.finite = torch.ones(largest, dtype=torch.bool, device=device)   # the drafter's logits were finite
        self.logprobs = False   # the step's verify returns its logits too (a request asked for logprobs)
        self.processed: list = []   # the step's rows whose requests ask for penalties or min_p, and the requests
        self.no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)   # the prompt mask of a row without penalties
        self.carry = proposer.carry(largest) if draft_cache else None        # EAGLE: step i's hidden states for i + 1
        self.grow(0)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def graphed(self, bucket: int) -> bool:
        return self.use_graphs and bucket <= MAX_GRAPH_BATCH

    def padded(self, bucket: int) -> bool:
        """Whether a verify step gives every row K + 1 queries (a graph's shapes, or the tests'
        PAD_EAGER_BATCHES); else each row has its own num_draft + 1, and a row that found fewer
        drafts (n-gram, a request near its end) costs only what it verifies."""
        return self.graphed(bucket) or PAD_EAGER_BATCHES

    def grow(self, k: int, probs: bool = False) -> None:
        """Make the static buffers hold a step of K = k at the largest bucket; graphs captured over
        smaller buffers are dropped (their addresses are gone)."""
        bucket = self.buckets[-1]
        # the fields, the drafts, every table entry as an update, a model proposer's usual catch-up
        size = (FIELDS + k) * bucket + 2 * self.row_width * bucket + 8 * (k + 2) * bucket
        if self.inputs is None or self.inputs.numel() < size:
            self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.host = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self.drop_graphs()
        if self.drafts is None or self.drafts.shape[1] < k:
            self.drafts = torch.zeros(bucket, k, dtype=torch.int64, device=self.device)
            self.drop_graphs()
        if probs and (self.draft_probs is None or self.draft_probs.shape[1] < k):
            self.draft_probs = torch.zeros(bucket, k, self.vocab, device=self.device)
            self.drop_graphs()

    def drop_graphs(self) -> None:
        """Forget every captured graph, and capture the next ones into a fresh pool. Reusing the old
        pool id once its last graph is gone trips PyTorch's allocator (`use_count > 0` INTERNAL ASSERT
        at the next capture, seen on an H100 with torch 2.11): a pool whose graphs are all destroyed
        may still hold blocks (outputs alive here), and only a new id starts a new pool."""
        self.graphs.clear()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()

    def upload(self, requests, num_draft: list[int], host_drafts: list[list[int]] | None = None,
               plan: Round | None = None) -> SamplingBatch:
        """Pack the step's host data (a model proposer's planned round too) and send it in one
        copy; returns the batch's sampling parameters on the device."""
        batch, bucket, k = len(requests), self.bucket(len(requests)), max(num_draft)
        self.grow(k)
        rows, pairs = self.tables.updates([r.block_table for r in requests])
        draft_rows = [self.draft_tables.null_row] * batch if self.draft_tables else [0] * batch
        if plan is not None:
            rows0, draft_pairs = self.draft_tables.updates([requests[b].proposer_state.block_table for b in plan.rows])
            pairs += draft_pairs
            for b, row in zip(plan.rows, rows0):
                draft_rows[b] = row
        buf = self.host.numpy()
        self.pack_rows(buf[:FIELDS * bucket].reshape(FIELDS, bucket), requests, num_draft, rows, draft_rows,
                       plan.first_position if plan else [0] * batch, plan.catch_up if plan else [0] * batch)
        end = (FIELDS + k) * bucket
        drafts = buf[FIELDS * bucket:end].reshape(bucket, k)
        drafts[:] = 0
        for b, d in enumerate(host_drafts or ()):
            drafts[b, :len(d)] = d
        buf[end:end + len(pairs)] = pairs
        n = end + len(pairs)
        extra = plan.host if plan else []
        fits = n + len(extra) <= len(buf)
        if fits:
            buf[n:n + len(extra)] = extra
        self.inputs[:n + fits * len(extra)].copy_(self.host[:n + fits * len(extra)], non_blocking=True)  # the copy
        if plan is not None:   # a round too long for the buffer (a draft's first, over whole prompts): its own copy
            plan.device = self.inputs[n:n + len(extra)] if fits else upload(list(extra), self.device)
        if n > end:   # most steps change no table: no launch
            self.apply_updates(self.inputs[end:n])
        fields = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        temperature, top_p = fields[6:8, :batch].view(torch.float64).float()
        self.finite.fill_(True)
        if host_drafts is not None:
            self.drafts[:bucket, :k].copy_(self.inputs[FIELDS * bucket:end].view(bucket, k))
        longest = max(r.num_cached + d + 1 for r, d in zip(requests, num_draft))
        params = [r.params for r in requests]
        probs = plan is not None and not all(p.temperature == 0 for p in params)
        self.step = (batch, bucket, k, longest, probs)
        self.logprobs = any(p.logprobs is not None for p in params)   # the verify also returns its logits
        self.processed = [(b, r) for b, r in enumerate(requests) if r.params.processed]   # (row, request)
        self.step_tokens = sum(num_draft) + bucket   # an unpadded verify's queries (a padding row has 1)
        return SamplingBatch(temperature, fields[5, :batch], top_p, fields[4, :batch],
                             greedy=all(p.temperature == 0 for p in params),
                             truncate=any(p.top_k or p.top_p < 1 for p in params) and Truncation(
                                 max(p.top_k for p in params), any(p.top_p < 1 for p in params),
                                 all(p.top_k for p in params if p.top_p < 1)))

    def pack_rows(self, fields: np.ndarray, requests, num_draft, rows, draft_rows, first_position, catch_up) -> None:
        """The FIELDS values of every row of the bucket into fields [FIELDS, bucket]; the rows past
        the batch are padding: greedy requests of one token at position 0 on the null rows."""
        batch, params = len(requests), [r.params for r in requests]
        fields[:, batch:] = 0
        fields[0, batch:] = self.tables.null_row
        fields[8, batch:] = self.draft_tables.null_row if self.draft_tables else 0
        fields[7, batch:] = ONE_BITS   # top_p 1: off
        fields[:6, :batch] = [rows, [r.num_cached for r in requests], num_draft, [r.tokens[-1] for r in requests],
                              [r.seed for r in requests], [p.top_k for p in params]]
        # float64 whatever the client sent: a batch of ints alone would make an int array, whose bits are no floats
        fields[6:8, :batch] = np.array([[p.temperature for p in params], [p.top_p for p in params]],
                                       dtype=np.float64).view(np.int64)
        fields[8, :batch], fields[9, :batch] = draft_rows, first_position
        fields[10, :batch] = [r.tokens[-2] if len(r.tokens) > 1 else 0 for r in requests]
        fields[11, :batch] = catch_up

    def mode(self, sampling: SamplingBatch, bucket: int):
        """How a step samples: "greedy", or its truncation (under a graph or a compiled sampler: any
        truncation or none, a shape-independent choice)."""
        if sampling.greedy:
            return "greedy"
        return bool(sampling.truncate) if self.graphed(bucket) or self.sampler.compiled else sampling.truncate

    @torch.inference_mode()
    def run_round(self, plan: Round, sampling: SamplingBatch) -> None:
        """A model proposer's round: the catch-up step eagerly, then steps 2..K (a graph); or, where
        every row's catch-up is short (a draft model's steady state), the whole round as one graph."""
        batch, bucket, step_k, longest, probs = self.step
        if probs:
            self.grow(step_k, probs=True)
        k = plan.k   # its own rows' most drafts (<= the step's K)
        if plan.shape.max_q <= self.proposer.graphed_catch_up:
            self.replay(("round", bucket, k, self.mode(sampling, bucket), probs, True), plan.width)
            return
        fields = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        shape, block_size = plan.shape, self.proposer.kv_cache.block_size
        meta_size = 2 * shape.batch + shape.extra
        rows = plan.device[meta_size:meta_size + shape.batch]
        tables = self.draft_tables.tables[fields[8][rows], :plan.first_width]
        meta = derive_metadata(plan.device[:meta_size], shape, block_size, tables)
        logits = self.proposer.first_step(meta, plan, rows, self.carry)
        self.finite[rows] &= logits.amax(-1).isfinite()   # NaN or +inf anywhere in a row shows in its max
        tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, fields[1][rows] + 1)
        self.drafts[rows, 0] = tokens
        if probs:
            self.draft_probs[rows, 0] = q
        if k > 1:
            self.replay(("round", bucket, k, self.mode(sampling, bucket), probs, False), plan.width)

    @torch.inference_mode()
    def run(self, sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The verification of the uploaded step's drafts. Returns [bucket, K + 3] (see the module's
        docstring), the target's features for EAGLE ([bucket * (K + 1), F], request b's at rows
        b * (K + 1) ...) and, where a request asked for logprobs, the target's raw logits at each
        row's K + 1 queries ([bucket, K + 1, vocab], from an eager step; else None)."""
        batch, bucket, k, longest, probs = self.step
        eager = self.logprobs or bool(self.processed)   # (see replay)
        return self.replay(("verify", bucket, k, self.mode(sampling, bucket), probs, eager),
                           self.kv_cache.allocator.blocks_for(longest))

    def replay(self, key, width: int):
        """Run the body of `key`: eagerly at `width` (the widest table it reads), or as a graph."""
        if key[0] == "verify" and key[5]:
            # A verify with logprobs, penalties or min_p: its forward as the ("forward", bucket, K)
            # graph, its tail eagerly. The whole step as a graph would keep [bucket, K + 1, vocab]
            # logits in the pool for good (one such graph per bucket, K and mode), and the penalties
            # read the requests' tokens on the host; the forward's outputs are a few rows a query.
            return self.verify_tail(key, *self.replay(("forward", *key[1:3]), width))
        body = {"verify": self.verify_body, "forward": self.forward_body, "round": self.round_body}[key[0]]
        if not self.graphed(key[1]):
            if REHEARSE_GRAPHS:   # as capture (a warm-up) and replay would: twice, at full width
                width = self.full_width(key)
                body(key, width)
            return body(key, width)
        if key not in self.graphs:
            self.graphs[key] = self.capture(body, key)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def full_width(self, key) -> int:
        return (self.draft_tables if key[0] == "round" else self.tables).width

    @torch.inference_mode()
    def capture(self, body, key):
        """Warm up on a side stream (it runs the current step, which replay then repeats: the same
        writes), then capture the body at full width into the shared pool."""
        width = self.full_width(key)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body(key, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = body(key, width)
        return graph, outputs

    @torch.inference_mode()
    def capture_all(self, ks) -> None:
        """Capture the greedy verify step of every bucket up to MAX_GRAPH_BATCH for each K in ks,
        largest bucket first (the smaller graphs then fit in the pool memory the larger ones left),
        on inputs that are all padding rows, so the warm-ups write only sink blocks. Draft rounds
        and sampling steps are captured on first use."""
        if not self.use_graphs:
            return
        self.grow(max(ks))
        for bucket in sorted((b for b in self.buckets if b <= MAX_GRAPH_BATCH), reverse=True):
            for k in sorted(ks, reverse=True):
                self.upload_padding(bucket, k)
                key = ("verify", bucket, k, "greedy", False, False)
                if key not in self.graphs:
                    self.graphs[key] = self.capture(self.verify_body, key)

    def upload_padding(self, bucket: int, k: int) -> None:
        """Inputs of a (bucket, k) step whose every row is padding."""
        buf = self.host.numpy()
        self.pack_rows(buf[:FIELDS * bucket].reshape(FIELDS, bucket), [], [], [], [], [], [])
        n = (FIELDS + k) * bucket
        buf[FIELDS * bucket:n] = 0
        self.inputs[:n].copy_(self.host[:n], non_blocking=True)
        self.drafts.zero_()

    def fields(self, bucket: int, mode):
        """The per-row fields on the device, and a SamplingBatch of them (`mode` says how it samples)."""
        fields = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        temperature, top_p = fields[6:8].view(torch.float64).float()
        sampling = SamplingBatch(temperature, fields[5], top_p, fields[4], greedy=mode == "greedy",
                                 truncate=mode if mode != "greedy" else False)
        return fields, sampling

    def padded_metadata(self, tables: torch.Tensor, cached: torch.Tensor, num_new: torch.Tensor, q_len: int,
                        block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata of q_len queries per row over tables [bucket, width] on the device: row b's
        num_new[b] new tokens at positions cached[b] .. cached[b] + num_new[b] - 1, then padding
        queries that repeat its last real position (so they see the same keys) and write their K/V
        to the sink block. Also returns each query's real offset [bucket, q_len] (clamped to the
        last real one): where a row's logits are read."""
        bucket, device = len(cached), cached.device
        offsets = torch.arange(q_len, device=device)
        real_offsets = torch.minimum(offsets[None, :], (num_new[:, None] - 1).clamp(min=0))   # [bucket, q_len]
        positions = cached[:, None] + real_offsets
        blocks = tables.gather(1, positions // block_size)
        slots = padding_to_sink(blocks, blocks * block_size + positions % block_size, block_size)   # padding rows'
        slots = torch.where(offsets[None, :] < num_new[:, None], slots, SINK_BLOCK * block_size + offsets % block_size)
        flat = torch.arange(bucket * q_len, device=device)
        meta = AttentionMetadata(
            slot_mapping=slots.flatten(), block_tables=tables, context_lens=cached + num_new,
            query_start=torch.arange(bucket + 1, device=device) * q_len, token_seq=flat // q_len,
            positions=positions.flatten(), query_index=flat.view(bucket, q_len),
            query_valid=torch.ones(bucket, q_len, dtype=torch.bool, device=device))
        return meta, real_offsets

    def verify_body(self, key, width: int):
        """The verification on the static buffers: the metadata, the target's forward over
        [last token, d_1 .. d_K] per row, acceptance and sampling. No host data, no sync."""
        return self.verify_tail(key, *self.forward_body(key, width))

    def forward_body(self, key, width: int):
        """The verification's first part: the metadata and the target's forward. Returns the final
        hidden states [T, hidden], EAGLE's features ([bucket * (K + 1), F], request b's at rows
        b * (K + 1) ...; else None) and pick: [T, ...] -> [bucket, K + 1, ...], each row's K + 1
        queries (past its last real query, its last again)."""
        bucket, k = key[1], key[2]
        q_len = k + 1
        table_row, cached, num_draft, last = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)[:4]
        tables = self.tables.tables[table_row, :width]
        input_ids = torch.cat([last[:, None], self.drafts[:bucket, :k]], dim=1).flatten()   # [bucket * q_len], row-major
        padded = self.padded(bucket)
        if padded:   # every row q_len queries: a graph's fixed shapes
            meta, real_offsets = self.padded_metadata(tables, cached, num_draft + 1, q_len, self.kv_cache.block_size)

            def pick(x):   # [bucket * q_len, ...] -> [bucket, q_len, ...], each query at its real offset
                x = x.view(bucket, q_len, *x.shape[1:])
                return x.gather(1, real_offsets.view(bucket, q_len, *[1] * (x.dim() - 2)).expand(x.shape))
        else:   # each row its own num_draft + 1 queries (the host knows their total): no padding computed
            meta = ragged_metadata(tables, cached, num_draft + 1, self.step_tokens, q_len, self.kv_cache.block_size,
                                   padding_rows=bucket > self.step[0])
            input_ids = input_ids[meta.token_seq * q_len + meta.positions - cached[meta.token_seq]]
            real_offsets = torch.minimum(torch.arange(q_len, device=self.device)[None, :], num_draft[:, None])
            rows = meta.query_start[:-1, None] + real_offsets   # [bucket, q_len]: each query's row in the pass

            def pick(x):   # [T, ...] -> [bucket, q_len, ...], past a row's last query its last
                return x[rows]
        proposer = self.proposer
        capture = proposer.capture_layers if proposer else ()
        hidden, captured = self.model(input_ids, meta.positions, self.kv_cache, meta, capture)
        features = proposer.features(hidden, captured) if proposer and proposer.needs_features else None
        if features is not None and not padded:
            features = pick(features).flatten(0, 1)   # request b's at rows b * q_len ..., as a graph's
        return hidden, features, pick

    def verify_tail(self, key, hidden: torch.Tensor, features: torch.Tensor | None, pick):
        """The verification's second part: the LM head, the logits' processing where the step has
        it (an eager step: see replay), acceptance and sampling. Returns what run() returns."""
        _, bucket, k, mode, probs, eager = key
        fields, sampling = self.fields(bucket, mode)
        cached, num_draft = fields[1], fields[2]
        drafts = self.drafts[:bucket, :k]
        logits = self.model.logits(hidden)[:, :self.vocab]
        kept = pick(logits) if eager and self.logprobs else None   # [bucket, q_len, vocab], raw
        processed = self.process(pick(logits), drafts) if eager and self.processed else None
        if mode == "greedy" and processed is not None:
            row_max, target_ids = processed.max(-1)
            tokens, num_accepted = self.sampler.verify_greedy(target_ids, drafts, num_draft)
        elif mode == "greedy":   # the argmax of each row, then the padded gather: ids, not [B, K+1, V] logits
            row_max, target_ids = logits.max(-1)
            row_max, target_ids = pick(row_max), pick(target_ids)
            tokens, num_accepted = self.sampler.verify_greedy(target_ids, drafts, num_draft)
        else:
            logits = pick(logits) if processed is None else processed
            row_max = logits.amax(-1)
            q = self.draft_probs[:bucket, :k] if probs else None
            if probs and self.proposer.host_and_model:   # a hybrid's suffix drafts: one-hot
                one_hot = torch.zeros_like(q).scatter_(-1, drafts[..., None], 1.0)
                q = torch.where((fields[9] == 0)[:, None, None], one_hot, q)   # first_position 0: not in the round
            tokens, num_accepted = self.sampler.rejection_sample(
                logits, drafts, q, num_draft, sampling.temperature,
                sampling.top_k, sampling.top_p, sampling.seeds, cached + 1, mode)
        # NaN or +inf in a row shows in its max; a broken model is found here, not by its garbage.
        broken = (~row_max.isfinite().all(-1)).long() + 2 * (~self.finite[:bucket]).long()
        return torch.cat([tokens, num_accepted[:, None], broken[:, None]], dim=1), features, kept

    def process(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The step's logits [bucket, K + 1, vocab] in float32, the processed rows' with their
        penalties and then their min_p, as vLLM orders them (the sampler's temperature, top-k and
        top-p come after), all rows in one batch. Eager only (see replay): it reads the requests'
        tokens on the host and sends them, with the rows and their parameters, in one copy."""
        logits = logits.float()
        vocab, reqs = logits.shape[-1], [r for _, r in self.processed]
        for req in reqs:
            if req.params.penalized and req.prompt_mask is None:   # made once per request: a prompt may be long
                req.prompt_mask = prompt_mask(req.prompt_ids, vocab, logits.device)
        n = len(reqs)
        # a row without penalties takes neutral ones (an identity, bit for bit), a greedy row min_p 0 at T 1
        values = np.array([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty,
                            r.params.min_p if r.params.temperature > 0 else 0.0, r.params.temperature or 1.0]
                           for r in reqs], dtype=np.float64).T.copy().view(np.int64)   # [5, n], float64 bits
        outputs = [np.asarray(r.output_ids if r.params.penalized else (), dtype=np.int64) for r in reqs]
        flat = np.concatenate([i * vocab + ids for i, ids in enumerate(outputs)])   # each output token at row * V + id
        host = np.concatenate([[b for b, _ in self.processed], values.ravel(), flat])
        device = upload(host, logits.device)
        rows, (repetition, frequency, presence, min_p, temperature) = device[:n], device[n:6 * n].view(5, n).view(
            torch.float64).float()
        counts = torch.zeros(n * vocab, device=logits.device).index_add_(
            0, device[6 * n:], torch.ones(len(flat), device=logits.device)).view(n, vocab)
        in_prompt = torch.stack([r.prompt_mask if r.params.penalized else self.no_prompt for r in reqs])
        out = penalize(logits[rows], in_prompt, counts, drafts[rows], repetition, frequency, presence)
        logits[rows] = min_p_mask(out, temperature, min_p)
        return logits

    def round_body(self, key, width: int) -> None:
        """A model proposer's draft steps for every row of the bucket: step 1 (with_first: a draft
        model's catch-up of 1 or 2 positions, padded to 2) and steps 2..K, where step i feeds
        d_{i-1} at the row's next position (d_1's plus i - 2) and draws d_i. A row past its own K
        drafts on at position 0 into the sink block; its drafts there are never verified."""
        _, bucket, k, mode, probs, with_first = key
        fields, sampling = self.fields(bucket, mode)
        cached, num_draft, draft_row, first_position = fields[1], fields[2], fields[8], fields[9]
        block_size = self.proposer.kv_cache.block_size
        rows = torch.arange(bucket, device=self.device)
        tables = self.draft_tables.tables[draft_row, :width]
        if with_first:
            self.first_draft_step(fields, sampling, tables, probs)
        # EAGLE: the first step's hidden states, read here and never written, so that a second run
        # of this body (a graph's replay after its warm-up) starts from the same state.
        hidden = self.carry[:bucket] if self.carry is not None else None
        in_round = first_position > 0   # a hybrid's other rows carry host drafts the round must not overwrite
        for i in range(1, k):
            active = (num_draft > i) & in_round
            meta = decode_metadata(tables, torch.where(active, first_position + i - 1, 0), block_size)
            meta.slot_mapping = torch.where(active, meta.slot_mapping, SINK_BLOCK * block_size)
            if hidden is not None:   # an idle row starts from zeros: iterating its own output could overflow
                hidden = torch.where(active[:, None], hidden, 0)
            logits, hidden = self.proposer.next_step(meta, self.drafts[:bucket, i - 1], hidden)
            self.finite[:bucket] &= ~active | logits.amax(-1).isfinite()
            tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, cached + 1 + i)
            self.drafts[:bucket, i] = torch.where(in_round, tokens, self.drafts[:bucket, i])
            if probs:
                self.draft_probs[:bucket, i] = q

    def first_draft_step(self, fields, sampling: SamplingBatch, tables: torch.Tensor, probs: bool) -> None:
        """A draft model's first step in a graph: row b feeds its last catch_up[b] tokens (1 or 2:
        [previous, last] or [last]; 0 for a row that drafts nothing, whose queries go to the null
        block) and draws d_1 from the logits of its last real query."""
        bucket = fields.shape[1]
        cached, last, first_position, previous, catch_up = fields[1], fields[3], fields[9], fields[10], fields[11]
        meta, real_offsets = self.padded_metadata(tables, first_position - catch_up, catch_up, 2,
                                                  self.proposer.kv_cache.block_size)
        input_ids = torch.where((real_offsets == 0) & (catch_up[:, None] == 2), previous[:, None], last[:, None])
        rows = torch.arange(bucket, device=self.device)
        logits = self.proposer.catch_up_step(meta, input_ids.flatten(), rows * 2 + real_offsets[:, 1])
        self.finite[:bucket] &= (catch_up == 0) | logits.amax(-1).isfinite()
        tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, cached + 1)
        self.drafts[:bucket, 0] = torch.where(catch_up > 0, tokens, self.drafts[:bucket, 0])
        if probs:
            self.draft_probs[:bucket, 0] = q

    def apply_updates(self, pairs: torch.Tensor) -> None:
        """Write the uploaded (flat index, block id) pairs into the device tables, eagerly, before
        any graph of the step reads them (no graph holds a pair count of its own)."""
        pairs = pairs.view(-1, 2)
        self.flat_tables.scatter_(0, pairs[:, 0], pairs[:, 1])   # no sync, where indexing could need one
