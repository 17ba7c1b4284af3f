"""The decode / verify step in the GPU's shape: static buffers per (batch bucket, query length),
captured as a CUDA graph and replayed on CUDA; on CPU, and with enforce_eager, the same body runs
eagerly on the same buffers, so every CPU test runs the padded, bucketed step a GPU replays.

What a step takes from the host is one int64 buffer, copied once (pinned, non-blocking on CUDA):
  FIELDS rows of `bucket` values: per batch row its table row, cached tokens, number of drafts,
      last token, seed, top_k, and temperature and top_p as the bits of their float64 values;
  [bucket, K] drafts made on the host (n-gram; zeros for the others);
  the block-table updates since the last step: their count, then (flat index, block id) pairs.
What it gives back is one [bucket, K + 2] int64 tensor: each row's K + 1 tokens, its accepted
count and a flag for non-finite logits (read by the engine in its one copy back).

Padding keeps the step lossless:
- a bucket's rows past the batch are requests of one token at position 0 whose block-table row is
  the null row (every entry the null block, which the allocator never hands out). They write and
  read only the null block, whose slots stay finite (kv_cache.py), and nothing reads their output.
- a request with fewer drafts than the step's K repeats its last real query in the padded
  positions (the same position, so the same keys), writes their K/V to the null block (it may own
  no block there), and its logits rows there are replaced by its last real one before sampling.
- every draft id in the static buffer, stale or padding, is a token id, so the embedding can read it.

On CUDA the graphs share one memory pool and are captured on first use; batches above
MAX_GRAPH_BATCH run the body eagerly. The body reads block tables at their full width under a
graph and at the batch's widest table when eager (the same values; only the padding is shorter).
"""
from __future__ import annotations

import numpy as np
import torch

from nanospec.kv_cache import NULL_BLOCK, AttentionMetadata, BlockTable, KVCache, upload
from nanospec.sampler import SamplingBatch, Truncation

FIELDS = 8              # per-row values in the host buffer (see the module's docstring)
MAX_GRAPH_BATCH = 256   # larger batches run the same body eagerly
ONE_BITS = int(np.array(1.0).view(np.int64))


def batch_buckets(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then every 8 up to 64 and every 16 after, up to the
    first that holds max_batch."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return sizes


class DeviceBlockTables:
    """The block tables of the running requests on the device, one row per request, kept current by
    the updates each step sends: only the ids a BlockTable has gained since it was last synced."""

    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.width = width
        self.null_row = num_rows                  # all NULL_BLOCK, never written
        self.tables = torch.full((num_rows + 1, width), NULL_BLOCK, dtype=torch.int64, device=device)
        self.free_rows = list(range(num_rows - 1, -1, -1))

    def updates(self, tables: list[BlockTable]) -> tuple[list[int], list[int]]:
        """Each table's row (assigned on first use) and the flat (index, id) pairs to write."""
        rows, pairs = [], []
        for table in tables:
            if table.row is None:
                table.row = self.free_rows.pop()
            rows.append(table.row)
            base = table.row * self.width
            for j in range(table.synced, len(table)):
                pairs += (base + j, table[j])
            table.synced = len(table)
        return rows, pairs

    def release(self, table: BlockTable) -> None:
        if table.row is not None:
            self.free_rows.append(table.row)
            table.row, table.synced = None, 0


class StepGraphs:
    """The target's verify step (K = 0: plain decoding) with its acceptance and sampling, on static
    buffers, keyed by (bucket, K, sampling mode); `upload` then `run` is one step."""

    def __init__(self, model, kv_cache: KVCache, vocab: int, max_num_seqs: int, max_model_len: int,
                 device: torch.device, sampler, proposer=None, use_graphs: bool = False):
        self.model, self.kv_cache, self.vocab, self.device, self.sampler = model, kv_cache, vocab, device, sampler
        self.proposer = proposer
        self.buckets = batch_buckets(max_num_seqs)
        allocator = kv_cache.allocator   # a table holds at most the blocks of max_model_len, or of the pool
        self.tables = DeviceBlockTables(max_num_seqs, min(allocator.blocks_for(max_model_len), allocator.num_blocks), device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs = {}   # key -> (graph, its output tensors)
        self.inputs = self.host = None
        self.drafts = self.draft_probs = None
        self.grow(1, 0)

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def grow(self, bucket: int, k: int, probs: bool = False) -> None:
        """Make the static buffers hold a (bucket, k) step; a graph captured over smaller ones is
        dropped (its addresses are gone), so buffers grow to the largest bucket at once."""
        bucket = max(bucket, self.buckets[-1])
        # room for the fields, the drafts, every table entry as an update, and a model proposer's
        # usual round (its first step's tables, a few tokens per request, the later steps' rows)
        size = FIELDS * bucket + bucket * k + 1 + 2 * bucket * self.tables.width + bucket * (self.tables.width + 8 * (k + 2))
        if self.inputs is None or self.inputs.numel() < size:
            self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.host = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self.graphs.clear()
        if self.drafts is None or self.drafts.shape[1] < k:
            self.drafts = torch.zeros(bucket, k, dtype=torch.int64, device=self.device)
            self.graphs.clear()
        if probs and (self.draft_probs is None or self.draft_probs.shape[1] < k):
            self.draft_probs = torch.zeros(bucket, k, self.vocab, device=self.device)
            self.graphs.clear()

    def upload(self, requests, num_draft: list[int], host_drafts: list[list[int]] | None,
               extra: list[int] = ()) -> tuple[SamplingBatch, torch.Tensor]:
        """Pack the step's host data, and `extra` (a model proposer's round), send it in one copy,
        and return the batch's sampling parameters (the proposer draws with them) and `extra` on
        the device."""
        batch, bucket, k = len(requests), self.bucket(len(requests)), max(num_draft)
        self.grow(bucket, k)
        rows, pairs = self.tables.updates([r.block_table for r in requests])
        buf = self.host.numpy()
        fields = buf[:FIELDS * bucket].reshape(FIELDS, bucket)
        fields[:, batch:] = 0   # padding rows: greedy requests of one token at position 0 on the null row
        fields[0, batch:] = self.tables.null_row
        fields[7, batch:] = ONE_BITS   # top_p 1: off
        params = [r.params for r in requests]
        fields[:6, :batch] = [rows, [r.num_cached for r in requests], num_draft, [r.tokens[-1] for r in requests],
                              [r.seed for r in requests], [p.top_k for p in params]]
        fields[6:, :batch] = np.array([[p.temperature for p in params], [p.top_p for p in params]]).view(np.int64)
        end = FIELDS * bucket + bucket * k
        drafts = buf[FIELDS * bucket:end].reshape(bucket, k)
        drafts[:] = 0
        if host_drafts is not None:
            for b, d in enumerate(host_drafts):
                drafts[b, :len(d)] = d
        buf[end] = len(pairs) // 2
        buf[end + 1:end + 1 + len(pairs)] = pairs
        n = end + 1 + len(pairs)
        fits = n + len(extra) <= len(buf)
        if fits:
            buf[n:n + len(extra)] = extra
        self.inputs[:n + fits * len(extra)].copy_(self.host[:n + fits * len(extra)], non_blocking=True)   # the one copy
        # ... but for a round too long for the buffer (a draft model's first, over whole prompts): a copy of its own
        extra_on_device = self.inputs[n:n + len(extra)] if fits else upload(list(extra), self.device)
        fields = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        temperature, top_p = fields[6:, :batch].view(torch.float64).float()
        self.step = (batch, bucket, k, len(pairs) // 2, max(r.num_cached + d + 1 for r, d in zip(requests, num_draft)))
        if host_drafts is not None:
            self.drafts[:bucket, :k].copy_(self.inputs[FIELDS * bucket:end].view(bucket, k))
        sampling = SamplingBatch(temperature, fields[5, :batch], top_p, fields[4, :batch],
                                 greedy=all(p.temperature == 0 for p in params),
                                 truncate=any(p.top_k or p.top_p < 1 for p in params) and Truncation(
                                     max(p.top_k for p in params), any(p.top_p < 1 for p in params)))
        return sampling, extra_on_device

    @torch.inference_mode()
    def run(self, sampling: SamplingBatch, draft_ids: torch.Tensor | None = None,
            draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The uploaded step, with the proposer's drafts (device tensors [batch, K], [batch, K, V])
        when it made them on the device. Returns [bucket, K + 2] (see the module's docstring) and
        the target's features for EAGLE ([bucket * (K + 1), F], request b's at rows b * (K + 1) ...)."""
        batch, bucket, k, num_pairs, longest = self.step
        if draft_ids is not None:
            self.drafts[:batch, :k].copy_(draft_ids)
        probs = draft_probs is not None and not sampling.greedy
        if probs:
            self.grow(bucket, k, probs=True)
            self.draft_probs[:batch, :k].copy_(draft_probs)
        mode = "greedy" if sampling.greedy else bool(sampling.truncate) if self.graphed(bucket) else sampling.truncate
        key = (bucket, k, mode, probs)
        if not self.graphed(bucket):
            width = self.kv_cache.allocator.blocks_for(longest)
            return self.body(key, width, num_pairs)
        if key not in self.graphs:
            self.graphs[key] = self.capture(key)
        graph, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def capture_all(self, ks) -> None:
        """Capture the greedy step of every bucket up to MAX_GRAPH_BATCH for each K in ks, largest
        bucket first (the smaller graphs then fit in the pool memory the larger ones left), on
        inputs that are all padding rows, so the warm-ups write only the null block. Sampling
        steps are captured on first use."""
        if not self.use_graphs:
            return
        for bucket in sorted((b for b in self.buckets if b <= MAX_GRAPH_BATCH), reverse=True):
            for k in sorted(ks, reverse=True):
                self.grow(bucket, k)
                self.upload_padding(bucket, k)
                key = (bucket, k, "greedy", False)
                if key not in self.graphs:
                    self.graphs[key] = self.capture(key)

    def upload_padding(self, bucket: int, k: int) -> None:
        """Inputs of a (bucket, k) step whose every row is padding, and no table update."""
        buf = self.host.numpy()
        fields = buf[:FIELDS * bucket].reshape(FIELDS, bucket)
        fields[:] = 0
        fields[0], fields[7] = self.tables.null_row, ONE_BITS
        n = FIELDS * bucket + bucket * k + 1
        buf[FIELDS * bucket:n] = 0
        self.inputs[:n].copy_(self.host[:n], non_blocking=True)
        self.drafts.zero_()

    def graphed(self, bucket: int) -> bool:
        return self.use_graphs and bucket <= MAX_GRAPH_BATCH

    def capture(self, key):
        """Warm up on a side stream (it runs the current step, which replay then repeats: the same
        writes), then capture the body at full width into the shared pool."""
        bucket, full = key[0], self.tables.width
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.body(key, full, bucket * full)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.body(key, full, bucket * full)
        return graph, outputs

    def body(self, key, width: int, num_pairs: int):
        """The step on the static buffers: table updates, the metadata, the target's forward over
        [last token, d_1 .. d_K] per row, acceptance and sampling. No host data, no sync."""
        bucket, k, mode, probs = key
        q_len, block_size, device = k + 1, self.kv_cache.block_size, self.device
        fields = self.inputs[:FIELDS * bucket].view(FIELDS, bucket)
        table_row, cached, num_draft, last, seeds, top_k = fields[:6]
        temperature, top_p = fields[6:].view(torch.float64).float()
        self.apply_updates(self.inputs[FIELDS * bucket + bucket * k:], num_pairs)
        offsets = torch.arange(q_len, device=device)
        real_offsets = torch.minimum(offsets[None, :], num_draft[:, None])       # [bucket, K + 1]
        positions = cached[:, None] + real_offsets                               # padding repeats the last real query
        tables = self.tables.tables[table_row, :width]
        slots = tables.gather(1, positions // block_size) * block_size + positions % block_size
        slots = torch.where(offsets[None, :] <= num_draft[:, None], slots, NULL_BLOCK * block_size + offsets % block_size)
        drafts = self.drafts[:bucket, :k]
        input_ids = torch.cat([last[:, None], drafts], dim=1).flatten()
        flat = torch.arange(bucket * q_len, device=device)
        meta = AttentionMetadata(
            slot_mapping=slots.flatten(), block_tables=tables, context_lens=cached + num_draft + 1,
            query_start=torch.arange(bucket + 1, device=device) * q_len, token_seq=flat // q_len,
            positions=positions.flatten(), query_index=flat.view(bucket, q_len),
            query_valid=torch.ones(bucket, q_len, dtype=torch.bool, device=device),
            attn_mask=(torch.arange(width * block_size, device=device)[None, None, :] <= positions[:, :, None])[:, None])
        proposer = self.proposer
        capture = proposer.capture_layers if proposer else ()
        hidden, captured = self.model(input_ids, meta.positions, self.kv_cache, meta, capture)
        features = proposer.features(hidden, captured) if proposer and proposer.needs_features else None
        logits = self.model.logits(hidden)[:, :self.vocab].view(bucket, q_len, -1)
        if mode == "greedy":   # the argmax of each row, then the padded gather: ids, not [B, K+1, V] logits
            row_max, target_ids = logits.max(-1)
            tokens, num_accepted = self.sampler.verify_greedy(target_ids.gather(1, real_offsets), drafts, num_draft)
        else:
            logits = logits.gather(1, real_offsets[:, :, None].expand(-1, -1, logits.shape[-1]))
            row_max = logits.amax(-1)
            tokens, num_accepted = self.sampler.rejection_sample(
                logits, drafts, self.draft_probs[:bucket, :k] if probs else None, num_draft, temperature, top_k,
                top_p, seeds, cached + 1, mode)
        # NaN or +inf in a row shows in its max; a broken model is found here, not by its garbage.
        broken = ~row_max.gather(1, real_offsets).isfinite().all(-1)
        return torch.cat([tokens, num_accepted[:, None], broken.long()[:, None]], dim=1), features

    def apply_updates(self, updates: torch.Tensor, num_pairs: int) -> None:
        """Write the uploaded (index, id) pairs into the device tables. A graph reads a fixed
        number of pairs: those past the step's count (stale) are sent to the null row's first
        entry, with its own value."""
        count, pairs = updates[0], updates[1:1 + 2 * num_pairs].view(num_pairs, 2)
        valid = torch.arange(num_pairs, device=self.device) < count
        index = torch.where(valid, pairs[:, 0], self.tables.null_row * self.tables.width)
        self.tables.tables.view(-1).scatter_(0, index, torch.where(valid, pairs[:, 1], NULL_BLOCK))
