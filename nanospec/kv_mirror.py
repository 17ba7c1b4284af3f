"""The reference attention's gathered K/V, kept from pass to pass on the CPU.

`kv_cache.paged_attention_reference` copies every sequence's pages into a padded [B, max_k] layout
in every layer of every pass, and reads that copy once. On a CPU the copy is memory traffic the size
of the batch's whole K/V, twice (read and written), and nearly all of it is what the last pass copied:
a decode step adds one token a sequence. A KVMirror keeps that padded layout for every layer of a
KVCache, one row per row of the pass's batch, and brings it up to date each pass instead of building
it again:

  - each layer writes its new tokens' K/V into the mirror (at their row and position), not the pool;
  - a row's blocks that the mirror does not hold as they are in the pool are copied in first: every
    block of a row whose sequence is new to that row, a block the row reaches for the first time
    (a few KB, once a block_size tokens), every block once after the mirror was made (the null
    block padding a row's table too, which then stays held);
  - the pool gets the pass's new K/V of every layer at once, in its last layer.

What the mirror holds is tracked by versions: every pass bumps the version of each block it writes,
and a mirror row records, per block, the id and version it holds. A row holds block j as the pool
does when the ids and versions match: no pass wrote that block since, except through this row (whose
writes went to both; a block another row of the same pass wrote too, as a draft tree's frontier rows
share their request's blocks, is recorded as not held). Rows of the pass are recorded as holding nothing
until its last layer has written them, so a pass that fails midway leaves them to be copied again.
Anything else that writes the pool drops the mirror (KVCache.clear, zero_blocks) or bumps the versions
of the blocks it wrote (KVCache.move_slots).

The attention itself is the reference's (kv_cache.padded_attention), over views of the mirror laid
out as the reference's gathered copy: every query reads the keys and values the reference would
(masked ones too, past a row's context: its own stale slots, the null block; never another
sequence's, whose NaN would pass through a masked weight of 0), so the output is the reference's
bit for bit (test_kv_mirror checks every layer of engines that batch, preempt, chunk
prefills, pad batches, roll drafts back and share cached prefixes). The mirror costs memory: as
much as the batch's padded K/V for every layer, bounded by the pool's own size or MIN_BUDGET (past
it, the pass takes the reference). CPU only, and not under autograd: on CUDA the fused kernel reads
the pages where they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanospec.kv_cache import (SINK_BLOCK, AttentionMetadata, KVCache, padded_attention,
                               paged_attention_reference, write_kv)

MIN_BUDGET = 64 << 20   # bytes the mirror may take whatever the pool's size (past it: the pool's size)
GROW_BLOCKS = 8         # the mirror's positions grow in steps of this many blocks


@dataclass
class Plan:
    """One pass's work on the mirror, made once (the first layer's) from the metadata on the host."""
    batch: int
    width: int                      # blocks a table holds in this pass (max_blocks)
    copy: tuple | None              # (rows, block indexes, block ids) to copy from the pool first
    # [T] where each new token's K/V goes in a layer's [2, kv_heads, rows * positions, head_dim]: its
    # row (padding's: the spare row) and position
    write_index: torch.Tensor
    held_ids: np.ndarray            # [B, width] the pass's tables: what its rows hold once it is written
    held_versions: np.ndarray       # ... at the versions the pass leaves them


class KVMirror:
    """The padded K/V of a KVCache's last passes, one tensor [layers, 2, kv_heads, rows, positions,
    head_dim]: row b of a pass reads [:, :, :, b, :max_k]. The K/V heads outermost, as the reference
    lays its gathered keys out: SDPA's result depends on its inputs' layout, not only their values.
    The last row is spare: the pass's padding tokens (those the pool sends to the sink block) write
    there, and nothing reads it."""

    def __init__(self, kv_cache: KVCache):
        self.pool = kv_cache.pool   # (not the KVCache, which holds the mirror: no reference cycle)
        layers, _, num_blocks, self.block_size, kv_heads, head_dim = self.pool.shape
        self.versions = np.zeros(num_blocks, dtype=np.int64)   # per block: passes that wrote it
        with torch.inference_mode(False):   # a normal tensor, written in any mode (as the pool is)
            self.kv = self.pool.new_zeros(layers, 2, kv_heads, 1, 0, head_dim)
        self.held_ids = np.full((0, 0), -1, dtype=np.int64)    # [rows - 1, blocks]: the block each holds,
        self.held_versions = np.zeros((0, 0), dtype=np.int64)  # at which version

    @classmethod
    def for_pass(cls, kv_cache: KVCache, meta: AttentionMetadata,
                 q: torch.Tensor) -> tuple[KVMirror, Plan] | None:
        """The cache's mirror and this pass's plan, or None where the pass takes the reference: off
        the CPU, under autograd, or where the mirror would outgrow the pool (it is dropped then)."""
        batch, width = meta.block_tables.shape
        autograd = torch.is_grad_enabled() and q.requires_grad
        wanted = kv_cache.use_mirror and q.device.type == "cpu" and not autograd
        mirror = (kv_cache.mirror or cls(kv_cache)) if wanted else None
        fits = mirror is not None and mirror.fit(batch + 1, width)
        # a pass that writes the pool itself leaves a mirror behind it: dropped
        kv_cache.mirror = mirror if fits else None
        return (mirror, mirror.plan(meta)) if fits else None

    def fit(self, rows: int, blocks: int) -> bool:
        """Room for `rows` rows of `blocks` blocks (blocks rounded up to GROW_BLOCKS, so that a
        growing context copies the mirror over once in GROW_BLOCKS blocks; what is held is kept);
        False where that would take more memory than the pool (or MIN_BUDGET)."""
        have_rows, have_blocks = self.held_ids.shape
        if rows - 1 <= have_rows and blocks <= have_blocks:
            return True
        rows = max(rows, have_rows + 1)
        blocks = -(-max(blocks, have_blocks) // GROW_BLOCKS) * GROW_BLOCKS
        layers, _, kv_heads, _, _, head_dim = self.kv.shape
        size = layers * 2 * rows * kv_heads * blocks * self.block_size * head_dim * self.kv.element_size()
        if size > max(self.pool.nbytes, MIN_BUDGET):
            return False
        with torch.inference_mode(False):
            kv = self.kv.new_zeros(layers, 2, kv_heads, rows, blocks * self.block_size, head_dim)
            kv[:, :, :, :have_rows, :self.kv.shape[4]] = self.kv[:, :, :, :have_rows]
        self.kv = kv
        grown = ((0, rows - 1 - have_rows), (0, blocks - have_blocks))   # new rows and blocks hold nothing
        self.held_ids = np.pad(self.held_ids, grown, constant_values=-1)
        self.held_versions = np.pad(self.held_versions, grown)
        return True

    def plan(self, meta: AttentionMetadata) -> Plan:
        """Which blocks to copy in, where the new tokens go, and what the rows will hold; bumps the
        versions of the blocks the pass writes. A row copies every block of its table (to the
        pass's width: the null block past its own) that it does not hold at its version, the masked
        ones too: a masked key weighs 0, and 0 * NaN is NaN, so a slot of another sequence's left in
        the row would pass that sequence's NaN on. The mirror then holds every key the reference
        reads, and what the pass writes it writes to both."""
        tables = meta.block_tables.numpy()
        batch, width = tables.shape
        slots, rows, positions = meta.slot_mapping.numpy(), meta.token_seq.numpy(), meta.positions.numpy()
        written = slots // self.block_size
        real = written != SINK_BLOCK   # padding tokens write to the sink: no row's
        held = ((self.held_ids[:batch, :width] == tables)
                & (self.held_versions[:batch, :width] == self.versions[tables]))
        copy_rows, copy_blocks = np.nonzero(~held)
        self.versions[written] += 1
        self.held_ids[:batch] = -1   # until the last layer has written the pass
        spare, length = self.kv.shape[3] - 1, self.kv.shape[4]
        # A block of a row's table that another row of the pass wrote (rows of one sequence: a draft
        # tree's frontier nodes) is not held as the pool holds it: the row has its own writes only.
        writer = np.full(len(self.versions), -1)    # per block: the row that wrote it (-2: several)
        writer[written[real]] = rows[real]
        # (numpy keeps the last of repeated assignments: a row other than the one kept wrote it too)
        writer[written[real][writer[written[real]] != rows[real]]] = -2
        by_other = (writer[tables] != -1) & (writer[tables] != np.arange(batch)[:, None])
        held_versions = np.where(by_other, -1, self.versions[tables])
        return Plan(batch, width,
                    (torch.from_numpy(copy_rows), torch.from_numpy(copy_blocks),
                     torch.from_numpy(tables[copy_rows, copy_blocks])) if len(copy_rows) else None,
                    torch.from_numpy(np.where(real, rows * length + positions, spare * length).astype(
                        np.int64, copy=False)),
                    tables.copy(), held_versions)

    def attention(self, layer: int, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        kv = self.kv[layer]   # [2, kv_heads, rows, positions, head_dim]
        if plan.copy is not None:
            rows, blocks, ids = plan.copy
            # [2, kv_heads, rows, blocks, block_size, hd]
            by_block = kv.view(*kv.shape[:3], -1, self.block_size, kv.shape[-1])
            by_block[:, :, rows, blocks] = self.pool[layer].index_select(1, ids).permute(0, 3, 1, 2, 4)
        flat = kv.view(2, kv.shape[1], -1, kv.shape[-1])   # [2, kv_heads, rows * positions, hd]
        flat[0].index_copy_(1, plan.write_index, k.transpose(0, 1))   # (padding's all to one spare slot)
        flat[1].index_copy_(1, plan.write_index, v.transpose(0, 1))
        # each [B, kv_heads, max_k, hd]
        keys, values = kv[:, :, :plan.batch, :plan.width * self.block_size].transpose(1, 2)
        out = padded_attention(q, keys, values, meta, scale, self.block_size)
        if layer == len(self.kv) - 1:
            self.write_pool(plan, meta)
        return out

    def write_pool(self, plan: Plan, meta: AttentionMetadata) -> None:
        """The pass's new K/V of every layer into the pool at once (its last layer), and the rows'
        blocks recorded as held."""
        # [layers, 2, kv_heads, T, hd]
        new = self.kv.view(*self.kv.shape[:3], -1, self.kv.shape[-1]).index_select(3, plan.write_index)
        pool = self.pool.view(*self.pool.shape[:2], -1, *self.pool.shape[4:])   # [layers, 2, slots, kv_h, hd]
        pool[:, :, meta.slot_mapping] = new.transpose(2, 3)
        self.held_ids[:plan.batch, :plan.width], self.held_versions[:plan.batch, :plan.width] = (
            plan.held_ids, plan.held_versions)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Layer `layer`'s attention of the pass's new tokens q over their sequences' pages, after storing
    their K/V (k, v [T, kv_heads, head_dim]): through the cache's mirror where the pass can take it,
    else written to the pool and read by the reference."""
    mirrored = meta.once(("mirror", id(kv_cache)), lambda: KVMirror.for_pass(kv_cache, meta, q))
    if mirrored is None:
        pages = kv_cache.layer(layer)
        write_kv(pages[0], pages[1], k, v, meta.slot_mapping)
        return paged_attention_reference(q, pages, meta, scale)
    mirror, plan = mirrored
    return mirror.attention(layer, plan, q, k, v, meta, scale)
