"""The decode step in the GPU's shape: static buffers per (batch bucket, K), captured as CUDA graphs
and replayed on CUDA; on CPU, and with enforce_eager, the same bodies run eagerly on the same
buffers: padded to the buckets as a GPU replays them with StepOptions.pad_batches (every test's
engine), else at the batch's own size with each row's own queries.

A step is `upload`, then `run_round` (a model proposer's K draft steps), then `run` (verify):
  upload  one int64 buffer from the host in one copy (pinned, non-blocking on CUDA): the rows'
          Fields, [bucket, K] host drafts (n-gram's, suffix decoding's, a hybrid's suffix rows;
          zeros for the others), a tree step's [bucket, K + 1] parent lists, the (flat index, block
          id) pairs the device block tables gained since the last step, and a model proposer's
          catch-up (its first draft step's cached counts, lengths and input ids).
  round   the catch-up step (each row feeds what the proposer has not seen: a varying length)
          eagerly, then steps 2..K as one graph whose positions advance on the device; where every
          catch-up is 1 or 2 positions (a draft model's steady state), the whole round is one graph.
          An EAGLE-2 tree: the catch-up and its top-k eagerly, then the later depths and the rerank
          as one graph over every row of the bucket (tree.grow_tree: its sizes fixed on the host).
          Drafts (a tree's parent lists), draft probabilities and a finiteness flag land in static
          buffers.
  verify  the target over [last token, d_1 .. d_K] for every row, acceptance and sampling, as one
          graph returning [bucket, K + 3] int64 (a tree's [bucket, 2K + 3]; Verified): the one copy
          back. A step with a request that asks for logprobs, penalties or min_p replays the
          forward alone as a graph and runs the rest eagerly (see replay).

Invariants:
- one copy in, one copy back: no other host data and no sync inside a step (logprobs, penalties
  and min_p add one copy each way, eagerly; a mixed step's prefill chunks one copy in; a round too
  long for the buffer a copy of its own; after the step, a tree's accepted paths are moved with
  one copy in: tree.follow_paths);
- buckets: a batch is padded to the next of batch_buckets (graphs up to MAX_GRAPH_BATCH; larger
  batches run the same bodies eagerly). A padding row is a request of one token at position 0
  whose block-table row is the null row: it reads only the null block (zero: nothing writes it),
  writes only the sink block (no table holds it), and nothing reads its output;
- a row with fewer drafts than the step's K repeats its last real query in the padded positions
  (the same position, so the same keys), writes their K/V to the sink block, and its logits there
  are replaced by its last real ones. In the draft round, a row past its own K drafts on at
  position 0 into the sink block. So a request's non-finite K/V stay in its own blocks: no other
  request reads them, even masked;
- every draft id in the static buffer, stale or padding, is a token id (the embedding reads it);
- every body is safe to run twice on the same buffers (capture warms up on the current step's
  inputs, then replay runs it again): nothing a body reads is written by it, except values it
  writes the same way every time (its K/V, drafts[:, i] from drafts[:, i - 1], a flag it only
  clears). StepOptions.rehearse makes an eager step run so (twice, at full width), and the tests
  compare that with the plain eager step;
- a body reads block tables at their full width under a graph and at the batch's widest table
  when eager (the same values; only the padding is shorter);
- the graphs share one memory pool; the LLM captures greedy verify steps at start (capture_all,
  largest bucket first), the others are captured on first use. Capture and every step run under
  inference mode.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from nanospec.kv_cache import (NULL_BLOCK, SINK_BLOCK, BlockTable, KVCache, MetadataShape, derive_metadata,
                               padded_metadata, query_runs, ragged_metadata, upload)
from nanospec.proposer import Round, align_vocab, draw
from nanospec.logits_processors import process
from nanospec.sampler import SamplingBatch, Truncation
from nanospec.tree import ancestors_of, grow_tree, mask_tree, root_children, verify_tree

MAX_GRAPH_BATCH = 256   # larger batches run the same bodies eagerly
ONE_BITS = int(np.array(1.0).view(np.int64))


@dataclass(frozen=True, slots=True)
class StepOptions:
    """How a step runs where no graph is replayed (a CPU, enforce_eager), and which attention the CPU
    takes. A GPU's graphs pad and run their bodies as capture and replay by construction; the tests
    build every engine with pad_batches (tests/conftest.py), so that each CPU test runs the step a
    GPU replays. Padding is off by default: on a CPU the padding rows cost what real rows cost, and
    so do the queries of drafts n-gram did not find."""
    pad_batches: bool = False   # pad the batch to the graphs' buckets, every row of a verify to K + 1
    rehearse: bool = False      # run each graph body twice at full width, as capture and replay would
    kv_mirror: bool = True      # CPU attention over kv_mirror.py's padded copy; off: the reference


@dataclass(frozen=True, slots=True)
class Fields:
    """The step's per-row values, each [bucket] int64: the rows of the upload's first block
    [FIELDS, bucket] (a numpy view on the host, a tensor view on the device)."""
    table_row: torch.Tensor        # the row of the target's device block table
    cached: torch.Tensor           # cached tokens: the last token's position
    num_draft: torch.Tensor        # the row's own K
    last: torch.Tensor             # its last token
    seed: torch.Tensor
    top_k: torch.Tensor
    temperature: torch.Tensor      # the bits of a float64
    top_p: torch.Tensor            # the bits of a float64
    draft_row: torch.Tensor        # the row of the proposer's device block table
    first_position: torch.Tensor   # the proposer's position for d_1 (0: the row is not in the round)
    previous: torch.Tensor         # the token before the last (0: none)
    catch_up: torch.Tensor         # positions the proposer's first step feeds (0: the row drafts nothing)


FIELDS = len(dataclasses.fields(Fields))
ROW = {f.name: i for i, f in enumerate(dataclasses.fields(Fields))}
FLOATS = slice(ROW["temperature"], ROW["top_p"] + 1)   # adjacent rows: converted in one op


@dataclass(frozen=True, slots=True)
class Verified:
    """One request's row of the verify step's output [bucket, K + 3], read on the host: its K + 1
    tokens, how many drafts it accepted, and a flag for non-finite logits (1: the target's, 2: the
    drafter's, 3: both). A tree's step has K more columns before the last two: the accepted path's
    nodes (tree.py), its `path`; a chain's is 1 .. accepted."""
    tokens: list[int]
    accepted: int
    non_finite: int
    path: list[int] | None = None

    @classmethod
    def rows(cls, out: torch.Tensor, tree: bool = False) -> list[Verified]:
        """out [batch, K + 3] (a tree's: [batch, 2K + 3]) on the host: the step's one copy back."""
        k = (out.shape[1] - 3) // 2 if tree else out.shape[1] - 3
        return [cls(row[:k + 1], row[-2], row[-1], row[k + 1:k + 1 + row[-2]] if tree else None)
                for row in out.tolist()]

    @property
    def emitted(self) -> list[int]:
        """The tokens the request emits: its accepted drafts and one more."""
        return self.tokens[:self.accepted + 1]


@dataclass(frozen=True, slots=True)
class GraphKey:
    """One body on one shape: a graph per key. body: "verify" (the whole verification), "forward"
    (its forward alone), "round" (a model proposer's draft steps) or "tree" (an EAGLE-2 tree's)."""
    body: str
    bucket: int
    k: int
    # how it samples (StepGraphs.mode): "greedy"; the step's exact Truncation (eager, uncompiled); or,
    # under a graph or a compiled sampler, True / False for some truncation or none (shapes fixed)
    mode: str | Truncation | bool = "greedy"
    probs: bool = False       # the drafts come with probabilities
    eager_tail: bool = False  # verify: the forward graph, then the rest eagerly (see replay)
    tree: bool = False        # verify: the drafts are trees (tree.py), not chains
    with_first: bool = False  # round: a draft model's first step in the graph too
    mixed: bool = False       # verify: prefill chunks ride in its forward (never a graph: eager)


@dataclass(slots=True)
class Step:
    """What the host knows of the uploaded step."""
    batch: int
    bucket: int
    k: int
    longest: int          # the longest row's positions after the verify
    probs: bool           # the drafts come with probabilities (a sampled step of a model proposer)
    logprobs: bool        # a request asked for logprobs: the verify returns its logits too
    processed: list       # (row, request) of the requests that ask for penalties or min_p
    tokens: int           # an unpadded verify's queries (a padding row has 1)
    mode: str | Truncation | bool = "greedy"   # "greedy", or its requests' exact truncation
    tree: tuple[int, int] | None = None   # a tree step's largest depth and branching (None: chains)
    chunk: tuple[torch.Tensor, MetadataShape] | None = None   # a mixed step's prefill chunks (with_chunk)
    runs: list[tuple[int, int, int]] | None = None   # an unpadded verify's rows by query count (query_runs)


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then every 8 up to 64 and every 16 after, up to the
    first that holds max_batch."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return sizes


def step_buckets(max_batch: int, padded: bool) -> list[int]:
    """The batch sizes an engine's steps run at: the graphs' buckets where steps are padded (graphs
    replayed, or StepOptions.pad_batches), else every size."""
    return batch_buckets(max_batch) if padded else list(range(1, max_batch + 1))


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
                 device: torch.device, sampler, proposer=None, use_graphs: bool = False,
                 options: StepOptions = StepOptions()):
        self.model, self.kv_cache, self.vocab, self.device = model, kv_cache, vocab, device
        self.sampler, self.proposer = sampler, proposer
        self.use_graphs = use_graphs and device.type == "cuda"
        self.options = options
        self.buckets = step_buckets(max_num_seqs, self.use_graphs or options.pad_batches)
        draft_cache = getattr(proposer, "kv_cache", None)
        # a table holds at most the blocks of max_model_len, or of the whole pool
        widths = [min(cache.allocator.blocks_for(max_model_len), cache.allocator.num_blocks) if cache else 0
                  for cache in (kv_cache, draft_cache)]
        self.flat_tables = torch.full(((max_num_seqs + 1) * sum(widths),), NULL_BLOCK, dtype=torch.int64,
                                      device=device)
        self.tables = DeviceBlockTables(self.flat_tables, 0, max_num_seqs, widths[0])
        self.draft_tables = DeviceBlockTables(self.flat_tables, (max_num_seqs + 1) * widths[0], max_num_seqs,
                                              widths[1]) if draft_cache else None
        self.row_width = sum(widths)   # table entries per request, target's and proposer's
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[GraphKey, tuple] = {}   # key -> (graph, its output tensors)
        self.inputs = self.host = self.drafts = self.draft_probs = None
        self.step: Step | None = None   # the uploaded step
        largest = self.buckets[-1]
        self.finite = torch.ones(largest, dtype=torch.bool, device=device)   # the drafter's logits are finite
        self.no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)   # a row's without penalties
        self.carry = proposer.carry(largest) if draft_cache else None   # EAGLE: step i's hidden states
        self.roots = proposer.tree_roots(largest) if getattr(proposer, "tree", None) else None   # EAGLE-2
        self.grow(0)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def graphed(self, bucket: int) -> bool:
        return self.use_graphs and bucket <= MAX_GRAPH_BATCH

    def padded(self, bucket: int) -> bool:
        """Whether a verify step gives every row K + 1 queries (a graph's shapes, or pad_batches);
        else each row has its own num_draft + 1, and a row that found fewer drafts (n-gram, a request
        near its end) costs only what it verifies."""
        return self.graphed(bucket) or self.options.pad_batches

    def sampling(self, bucket: int, mode: str | Truncation | bool) -> tuple[Fields, SamplingBatch]:
        """The per-row values of the uploaded step on the device, and a SamplingBatch of them as `mode`
        samples (Step.mode, StepGraphs.mode); temperature and top_p arrive as the bits of float64s."""
        block = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        temperature, top_p = block[FLOATS].view(torch.float64).float()
        fields, greedy = Fields(*block), mode == "greedy"
        return fields, SamplingBatch(temperature, fields.top_k, top_p, fields.seed, greedy=greedy,
                                     truncate=False if greedy else mode)

    def grow(self, k: int, probs: bool = False) -> None:
        """Make the static buffers hold a step of K = k at the largest bucket; graphs captured over
        smaller buffers are dropped (their addresses are gone)."""
        bucket = self.buckets[-1]
        # the fields, the drafts, every table entry as an update, a model proposer's usual catch-up
        size = (FIELDS + 2 * k + 1) * bucket + 2 * self.row_width * bucket + 8 * (k + 2) * bucket
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
        """Forget every captured graph, and capture the next ones into a fresh pool: a pool whose
        graphs are all destroyed may still hold blocks (outputs alive here), and reusing its id
        trips PyTorch's allocator (`use_count > 0` INTERNAL ASSERT at the next capture)."""
        self.graphs.clear()
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()

    def upload(self, requests, num_draft: list[int], host_drafts: list[list[int]] | None = None,
               plan: Round | None = None, parents: list[list[int]] | None = None,
               tree: tuple[int, int] | None = None,
               chunk: tuple[list[int], MetadataShape] | None = None) -> None:
        """Pack the step's host data (a model proposer's planned round too; host drafts' trees as
        their parent lists, a tree step's bounds: largest depth, branching) and send it in one copy.
        chunk: a mixed step's prefill chunks packed by kv_cache.pack_metadata, sent in a second copy."""
        batch, bucket, k = len(requests), self.bucket(len(requests)), max(num_draft)
        params = [r.params for r in requests]
        # a sampled step of a model proposer's chains: its drafts come with their probabilities
        probs = plan is not None and not plan.tree and any(p.temperature for p in params)
        self.grow(k, probs)
        rows, pairs = self.tables.updates([r.block_table for r in requests])
        fields = self.pack_rows(bucket, k, requests, num_draft, rows, host_drafts or (), parents, tree)
        if plan is not None:   # the round's rows: their proposer's table rows, positions and catch-ups
            draft_rows, draft_pairs = self.draft_tables.updates([requests[b].proposer_state.block_table
                                                                 for b in plan.rows])
            pairs += draft_pairs
            fields.draft_row[plan.rows] = draft_rows
            fields.first_position[:batch], fields.catch_up[:batch] = plan.first_position, plan.catch_up
        buf, end = self.host.numpy(), (FIELDS + k + (k + 1) * (tree is not None)) * bucket
        n, extra = end + len(pairs), plan.host if plan else []
        if n + len(extra) > len(buf):   # a round too long for the buffer (a draft's first, over prompts)
            plan.device, extra = upload(extra, self.device), []   # a copy of its own
        buf[end:n + len(extra)] = [*pairs, *extra]
        self.inputs[:n + len(extra)].copy_(self.host[:n + len(extra)], non_blocking=True)   # the one copy
        if plan is not None and plan.device is None:
            plan.device = self.inputs[n:n + len(extra)]
        if n > end:   # most steps change no table: no launch
            # the (flat index, block id) pairs into the device tables, eagerly, before any graph of the
            # step reads them (no graph holds a pair count of its own); a scatter: no sync, where
            # indexing could need one
            updates = self.inputs[end:n].view(-1, 2)
            self.flat_tables.scatter_(0, updates[:, 0], updates[:, 1])
        self.finite.fill_(True)
        if host_drafts is not None:
            self.drafts[:bucket, :k].copy_(self.inputs[FIELDS * bucket:(FIELDS + k) * bucket].view(bucket, k))
        longest = max(r.num_cached + d + 1 for r, d in zip(requests, num_draft))
        lens = [d + 1 for d in num_draft] + [1] * (bucket - batch)   # an unpadded verify's rows' queries
        if chunk is not None:   # (its host list begins with the chunks' cached counts, then their lengths)
            host, shape = chunk
            longest = max(longest, *(c + n for c, n in zip(host[:shape.batch], host[shape.batch:])))
            lens += host[shape.batch:2 * shape.batch]
        truncate = any(p.top_k or p.top_p < 1 for p in params) and Truncation(
            max(p.top_k for p in params), any(p.top_p < 1 for p in params),
            all(p.top_k for p in params if p.top_p < 1))
        self.step = Step(batch, bucket, k, mode=truncate if any(p.temperature for p in params) else "greedy",
                         probs=probs, logprobs=any(p.logprobs is not None for p in params),
                         processed=[(b, r) for b, r in enumerate(requests) if r.params.processed],
                         tokens=sum(num_draft) + bucket, longest=longest,
                         tree=tree, chunk=chunk and (upload(chunk[0], self.device), chunk[1]),
                         # only the unpadded forward reads them (a padded one gives every row K + 1)
                         runs=query_runs(lens) if chunk or not self.padded(bucket) else None)

    def pack_rows(self, bucket: int, k: int, requests=(), num_draft=(), rows=(), host_drafts=(),
                  parents=None, tree=None) -> Fields:
        """Into the host buffer: the Fields of every row of the bucket [FIELDS, bucket], as in a step
        without a draft round (upload writes a round's columns over them; returned: numpy views),
        then the [bucket, k] host drafts (zeros past a row's own), then for a tree step the [bucket,
        k + 1] parent lists (-2 past a row's own nodes; a round's trees are written there on the device).
        The rows past the batch are padding: greedy requests of one token at position 0 on the null
        rows."""
        buf = self.host.numpy()
        block = buf[:FIELDS * bucket].reshape(FIELDS, bucket)
        batch, params, fields = len(requests), [r.params for r in requests], Fields(*block)
        block[:] = 0
        fields.table_row[batch:] = self.tables.null_row
        fields.draft_row[:] = self.draft_tables.null_row if self.draft_tables else 0
        fields.top_p[batch:] = ONE_BITS   # top_p 1: off
        fields.table_row[:batch], fields.num_draft[:batch] = rows, num_draft
        fields.cached[:batch] = [r.num_cached for r in requests]
        fields.last[:batch] = [r.tokens[-1] for r in requests]
        fields.seed[:batch] = [r.seed for r in requests]
        fields.top_k[:batch] = [p.top_k for p in params]
        # float64 whatever the client sent: a batch of ints alone makes an int array, whose bits are no floats
        fields.temperature[:batch] = np.array([p.temperature for p in params], np.float64).view(np.int64)
        fields.top_p[:batch] = np.array([p.top_p for p in params], np.float64).view(np.int64)
        fields.previous[:batch] = [r.tokens[-2] if len(r.tokens) > 1 else 0 for r in requests]
        drafts = buf[FIELDS * bucket:(FIELDS + k) * bucket].reshape(bucket, k)
        drafts[:] = 0
        for b, d in enumerate(host_drafts):
            drafts[b, :len(d)] = d
        if tree is not None:
            lists = buf[(FIELDS + k) * bucket:(FIELDS + 2 * k + 1) * bucket].reshape(bucket, k + 1)
            lists[:] = -2
            lists[:, 0] = -1
            for b, ps in enumerate(parents or ()):
                lists[b, :len(ps)] = ps
        return fields

    def parents(self, bucket: int, k: int) -> torch.Tensor:
        """A tree step's parent lists on the device, [bucket, k + 1] (pack_rows)."""
        return self.inputs[(FIELDS + k) * bucket:(FIELDS + 2 * k + 1) * bucket].view(bucket, k + 1)

    def mode(self, step: Step) -> str | Truncation | bool:
        """How a step's graph bodies sample: "greedy" (every request is), or its truncation (under a
        graph or a compiled sampler: any truncation or none, a shape-independent choice)."""
        if step.mode != "greedy" and (self.graphed(step.bucket) or self.sampler.compiled):
            return bool(step.mode)
        return step.mode

    @torch.inference_mode()
    def run_round(self, plan: Round) -> None:
        """A model proposer's round: the catch-up step eagerly, then steps 2..K (a graph); or, where
        every row's catch-up is short (a draft model's steady state), the whole round as one graph."""
        step = self.step
        # plan.k: its own rows' most drafts (<= the step's K)
        key = GraphKey("round", step.bucket, plan.k, self.mode(step), step.probs)
        if plan.shape.max_q <= self.proposer.graphed_catch_up and not plan.tree:
            self.replay(dataclasses.replace(key, with_first=True), plan.width)
            return
        fields, sampling = self.sampling(step.bucket, step.mode)
        shape, block_size = plan.shape, self.proposer.kv_cache.block_size
        meta_size = 2 * shape.batch + shape.extra
        rows = plan.device[meta_size:meta_size + shape.batch]
        tables = self.draft_tables.tables[fields.draft_row[rows], :plan.first_width]
        meta = derive_metadata(plan.device[:meta_size], shape, block_size, tables)
        logits = self.proposer.first_step(meta, plan, rows, self.carry)
        self.finite[rows] &= logits.amax(-1).isfinite()   # NaN or +inf anywhere in a row shows in its max
        if plan.tree:   # EAGLE-2's tree: the root's children now, the later depths and the rerank a graph
            self.roots[0][rows], self.roots[1][rows] = root_children(logits, plan.tree[0], self.vocab)
            self.replay(GraphKey("tree", step.bucket, step.k), plan.width)
            return
        tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, fields.cached[rows] + 1)
        self.drafts[rows, 0] = tokens
        if step.probs:
            self.draft_probs[rows, 0] = q
        if plan.k > 1:
            self.replay(key, plan.width)

    @torch.inference_mode()
    def run(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The verification of the uploaded step's drafts. Returns [bucket, K + 3] (Verified; a tree
        step's [bucket, 2K + 3], its accepted paths too), the
        target's features for EAGLE ([bucket * (K + 1), F], request b's at rows b * (K + 1) ...)
        and, where a request asked for logprobs, the target's raw logits at each row's K + 1
        queries ([bucket, K + 1, vocab], from an eager step; else None)."""
        step = self.step
        key = GraphKey("verify", step.bucket, step.k, self.mode(step), step.probs,
                       eager_tail=step.logprobs or bool(step.processed), tree=step.tree is not None,
                       mixed=step.chunk is not None)
        return self.replay(key, self.kv_cache.allocator.blocks_for(step.longest))

    def replay(self, key: GraphKey, width: int):
        """Run the body of `key`: eagerly at `width` (the widest table it reads), or as a graph."""
        if key.eager_tail:
            # A verify with logprobs, penalties or min_p: its forward as a graph, its tail eagerly.
            # The whole step as a graph would keep [bucket, K + 1, vocab] logits in the pool for good
            # (one such graph per bucket, K and mode), and the penalties read the requests' tokens on
            # the host; the forward's outputs are a few rows a query.
            return self.verify_tail(key, *self.replay(GraphKey("forward", key.bucket, key.k, tree=key.tree,
                                                               mixed=key.mixed), width))
        body = getattr(self, f"{key.body}_body")   # verify_body, forward_body, round_body or tree_body
        if not self.graphed(key.bucket) or key.mixed:
            if self.options.rehearse:   # as capture (a warm-up) and replay would: twice, at full width
                width = self.full_width(key)
                body(key, width)
            return body(key, width)
        graph, outputs = self.capture(body, key)
        graph.replay()
        return outputs

    def full_width(self, key: GraphKey) -> int:
        return (self.draft_tables if key.body in ("round", "tree") else self.tables).width

    def capture(self, body, key: GraphKey) -> tuple:
        """The graph of body on key and its output tensors, captured on first use: warm up on a side
        stream (it runs the current step, which replay then repeats: the same writes), then capture
        the body at full width into the shared pool. (A replay only looks it up: no inference-mode
        context is entered on that path.)"""
        if key not in self.graphs:
            with torch.inference_mode():
                width = self.full_width(key)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    body(key, width)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    outputs = body(key, width)
                self.graphs[key] = graph, outputs
        return self.graphs[key]

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
                self.capture(self.verify_body, GraphKey("verify", bucket, k))

    def upload_padding(self, bucket: int, k: int) -> None:
        """Inputs of a (bucket, k) step whose every row is padding."""
        self.pack_rows(bucket, k)
        n = (FIELDS + k) * bucket
        self.inputs[:n].copy_(self.host[:n], non_blocking=True)
        self.drafts.zero_()

    def tree_bounds(self, key: GraphKey) -> tuple[int, int]:
        """The largest depth and branching a tree step's walk covers: the step's own (from the host)
        where it runs eagerly, K for both under a graph (any tree of K nodes fits)."""
        return (key.k, key.k) if self.graphed(key.bucket) else self.step.tree

    def verify_body(self, key: GraphKey, width: int):
        """The verification on the static buffers: the metadata, the target's forward over
        [last token, d_1 .. d_K] per row, acceptance and sampling. No host data, no sync."""
        return self.verify_tail(key, *self.forward_body(key, width))

    def forward_body(self, key: GraphKey, width: int):
        """The verification's first part: the metadata and the target's forward. Returns the final
        hidden states [T, hidden], EAGLE's features ([bucket * (K + 1), F], request b's at rows
        b * (K + 1) ...; else None) and pick: [T, ...] -> [bucket, K + 1, ...], each row's K + 1
        queries (past its last real query, its last again)."""
        bucket, q_len = key.bucket, key.k + 1
        fields = Fields(*self.inputs[:FIELDS * bucket].view(FIELDS, bucket))
        cached, num_draft = fields.cached, fields.num_draft
        tables = self.tables.tables[fields.table_row, :width]
        input_ids = torch.cat([fields.last[:, None], self.drafts[:bucket, :key.k]], dim=1).flatten()  # by row
        padded = self.padded(bucket) and not key.mixed
        if padded:   # every row q_len queries: a graph's fixed shapes
            meta, real_offsets = padded_metadata(tables, cached, num_draft + 1, q_len,
                                                 self.kv_cache.block_size)

            def pick(x):   # [bucket * q_len, ...] -> [bucket, q_len, ...], each query at its real offset
                x = x.view(bucket, q_len, *x.shape[1:])
                return x.gather(1, real_offsets.view(bucket, q_len, *[1] * (x.dim() - 2)).expand(x.shape))
        else:   # each row its own num_draft + 1 queries (the host knows their total): no padding computed
            rows_in = (tables, cached, num_draft + 1, self.step.tokens, q_len)
            meta = ragged_metadata(*(self.with_chunk(*rows_in) if key.mixed else rows_in),
                                   self.kv_cache.block_size, padding_rows=bucket > self.step.batch)
            meta.runs = self.step.runs   # (this branch is never captured in a graph)
            seq = meta.token_seq[:self.step.tokens]   # (a mixed step's chunk tokens come after these)
            input_ids = input_ids[seq * q_len + meta.positions[:self.step.tokens] - cached[seq]]
            if key.mixed:   # the chunks' tokens after the step's
                packed, shape = self.step.chunk
                input_ids = torch.cat([input_ids, packed[len(packed) - shape.extra:]])
            real_offsets = torch.minimum(torch.arange(q_len, device=self.device)[None, :], num_draft[:, None])
            rows = meta.query_start[:bucket, None] + real_offsets   # [bucket, q_len]: each query's row

            def pick(x):   # [T, ...] -> [bucket, q_len, ...], past a row's last query its last
                return x[rows]
        proposer = self.proposer
        capture = proposer.capture_layers if proposer else ()
        parents = self.parents(bucket, key.k) if key.tree else None
        positions = (mask_tree(meta, parents, cached, real_offsets, self.tree_bounds(key)[0]) if key.tree
                     else meta.positions)
        hidden, captured = self.model(input_ids, positions, self.kv_cache, meta, capture)
        features = proposer.features(hidden, captured) if proposer and proposer.needs_features else None
        if features is not None and not padded:
            features = pick(features).flatten(0, 1)   # request b's at rows b * q_len ..., as a graph's
        return hidden[:self.step.tokens] if key.mixed else hidden, features, pick   # (chunk rows come last)

    def with_chunk(self, tables: torch.Tensor, cached: torch.Tensor, lens: torch.Tensor, total: int,
                   max_q: int) -> tuple:
        """A mixed step's rows for ragged_metadata: the verify's, then its prefill chunks' (their
        tables padded with the null block to the verify's width), as (tables, cached, lens, total,
        max_q). Nothing reads a chunk row's logits; its tokens' K/V are cached."""
        packed, shape = self.step.chunk
        n, width = shape.batch, tables.shape[1]
        chunk_tables = packed[2 * n:2 * n + n * shape.max_blocks].view(n, shape.max_blocks)
        # to the verify's width: padded with the null block (a negative pad cuts)
        chunk_tables = torch.nn.functional.pad(chunk_tables, (0, width - shape.max_blocks), value=NULL_BLOCK)
        return (torch.cat([tables, chunk_tables]), torch.cat([cached, packed[:n]]),
                torch.cat([lens, packed[n:2 * n]]), total + shape.total, max(max_q, shape.max_q))

    def verify_tail(self, key: GraphKey, hidden: torch.Tensor, features: torch.Tensor | None, pick):
        """The verification's second part: the LM head, the logits' processing where the step has
        it (an eager tail: see replay), acceptance and sampling. Returns what run() returns."""
        fields, sampling = self.sampling(key.bucket, key.mode)
        drafts = self.drafts[:key.bucket, :key.k]
        logits = self.model.logits(hidden)[:, :self.vocab]
        eager = key.eager_tail
        kept = pick(logits) if eager and self.step.logprobs else None   # [bucket, q_len, vocab], raw
        processed = None
        if eager and self.step.processed:   # (in a tree, each position counts the drafts on its path)
            paths = (ancestors_of(self.parents(key.bucket, key.k), self.tree_bounds(key)[0])[:, :, 1:]
                     if key.tree else None)
            processed = process(pick(logits), drafts, self.step.processed, self.no_prompt, paths)
        if key.tree or key.mode != "greedy":   # every query's logits [bucket, q_len, vocab]
            logits = pick(logits) if processed is None else processed
            row_max = logits.amax(-1)
        if key.tree:   # deterministic candidates: host drafts, a drafter's top-k (tree.verify_tree)
            nodes = torch.cat([fields.last[:, None], drafts], dim=1)
            tokens, path, num_accepted = verify_tree(logits, nodes, self.parents(key.bucket, key.k), sampling,
                                                     key.mode, fields.cached + 1, self.tree_bounds(key)[0])
        elif key.mode == "greedy":
            if processed is not None:
                row_max, target_ids = processed.max(-1)
            else:   # each row's argmax, then the gather: ids, not [B, K+1, V] logits
                row_max, target_ids = map(pick, logits.max(-1))
            tokens, num_accepted = self.sampler.verify_greedy(target_ids, drafts, fields.num_draft)
        else:
            q = self.draft_probs[:key.bucket, :key.k] if key.probs else None
            if key.probs and self.proposer.host_and_model:   # a hybrid's suffix drafts: one-hot
                one_hot = torch.zeros_like(q).scatter_(-1, drafts[..., None], 1.0)
                q = torch.where((fields.first_position == 0)[:, None, None], one_hot, q)   # not in the round
            tokens, num_accepted = self.sampler.rejection_sample(
                logits, drafts, q, fields.num_draft, sampling.temperature,
                sampling.top_k, sampling.top_p, sampling.seeds, fields.cached + 1, key.mode)
        # NaN or +inf in a row shows in its max; a broken model is found here, not by its garbage.
        non_finite = (~row_max.isfinite().all(-1)).long() + 2 * (~self.finite[:key.bucket]).long()
        columns = [tokens] + ([path] if key.tree else []) + [num_accepted[:, None], non_finite[:, None]]
        return torch.cat(columns, dim=1), features, kept

    def round_body(self, key: GraphKey, width: int) -> None:
        """A model proposer's draft steps for every row of the bucket: step 1 (with_first: a draft
        model's catch-up of 1 or 2 positions, padded to 2) and steps 2..K, where step i feeds
        d_{i-1} at the row's next position (d_1's plus i - 2) and draws d_i. A row past its own K
        drafts on at position 0 into the sink block; its drafts there are never verified."""
        bucket = key.bucket
        fields, sampling = self.sampling(key.bucket, key.mode)
        block_size = self.proposer.kv_cache.block_size
        rows = torch.arange(bucket, device=self.device)
        tables = self.draft_tables.tables[fields.draft_row, :width]
        if key.with_first:
            self.first_draft_step(fields, sampling, tables, key.probs)
        # EAGLE: the first step's hidden states, read here and never written, so that a second run
        # of this body (a graph's replay after its warm-up) starts from the same state.
        hidden = self.carry[:bucket] if self.carry is not None else None
        in_round = fields.first_position > 0   # a hybrid's other rows carry host drafts the round must keep
        for i in range(1, key.k):
            active = (fields.num_draft > i) & in_round
            positions = torch.where(active, fields.first_position + i - 1, 0)
            meta, _ = padded_metadata(tables, positions, torch.ones_like(positions), 1, block_size)
            meta.slot_mapping = torch.where(active, meta.slot_mapping, SINK_BLOCK * block_size)
            if hidden is not None:   # an idle row starts from zeros: iterating its own output could overflow
                hidden = torch.where(active[:, None], hidden, 0)
            logits, hidden = self.proposer.next_step(meta, self.drafts[:bucket, i - 1], hidden)
            self.finite[:bucket] &= ~active | logits.amax(-1).isfinite()
            tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, fields.cached + 1 + i)
            self.drafts[:bucket, i] = torch.where(in_round, tokens, self.drafts[:bucket, i])
            if key.probs:
                self.draft_probs[:bucket, i] = q

    def tree_body(self, key: GraphKey, width: int) -> None:
        """EAGLE-2's trees (tree.grow_tree) for every row of the bucket, from the root's children that
        run_round left in self.roots: drafts and parent lists into the step's buffers (a row not in the
        round has no nodes: the parent list pack_rows wrote). No deeper than K: a tree of K nodes is not."""
        bucket = key.bucket
        fields = Fields(*self.inputs[:FIELDS * bucket].view(FIELDS, bucket))   # top-k: no sampling batch
        tokens, parents, finite = grow_tree(
            self.proposer, self.draft_tables.tables[fields.draft_row, :width], fields.first_position,
            [r[:bucket] for r in self.roots], None if self.carry is None else self.carry[:bucket],
            fields.num_draft, key.k, self.vocab)
        self.drafts[:bucket, :tokens.shape[1]] = tokens
        self.parents(bucket, key.k)[:, :parents.shape[1]] = parents
        self.finite[:bucket] &= finite

    def first_draft_step(self, fields: Fields, sampling: SamplingBatch, tables: torch.Tensor,
                         probs: bool) -> None:
        """A draft model's first step in a graph: row b feeds its last catch_up[b] tokens (1 or 2:
        [previous, last] or [last]; 0 for a row that drafts nothing, whose queries read the null
        row and write the sink block) and draws d_1 from the logits of its last real query."""
        catch_up = fields.catch_up
        bucket = len(catch_up)
        meta, real_offsets = padded_metadata(tables, fields.first_position - catch_up, catch_up, 2,
                                             self.proposer.kv_cache.block_size)
        input_ids = torch.where((real_offsets == 0) & (catch_up[:, None] == 2), fields.previous[:, None],
                                fields.last[:, None])
        rows = torch.arange(bucket, device=self.device)
        logits = self.proposer.catch_up_step(meta, input_ids.flatten(), rows * 2 + real_offsets[:, 1])
        self.finite[:bucket] &= (catch_up == 0) | logits.amax(-1).isfinite()
        tokens, q = draw(align_vocab(logits, self.vocab), sampling, rows, fields.cached + 1)
        self.drafts[:bucket, 0] = torch.where(catch_up > 0, tokens, self.drafts[:bucket, 0])
        if probs:
            self.draft_probs[:bucket, 0] = q
