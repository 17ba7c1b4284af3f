"""Paged KV cache: a block allocator over one preallocated pool, and attention that reads the pages.

Invariants:
- the pool is one tensor [layers, 2 (k/v), num_blocks, block_size, kv_heads, head_dim];
  token position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size;
- a slot holds the K/V of the token at its position; rolling a sequence back only moves its length
  back and frees the blocks wholly past it, so the kept slots stay valid (the next step writes the
  rejected drafts' slots again; a tree step moves its accepted path down: KVCache.move_slots);
- a sequence writes only its own blocks: a block belongs to one sequence, except that with prefix
  caching a full block of committed tokens may be shared, read-only (a sequence writes positions
  from its num_cached on, past every shared block), by the sequences whose tokens begin the same;
  a block returns to the free list when the last sequence holding it finishes or is preempted
  (tests check that no block leaks);
- prefix caching: a full block whose tokens, and all tokens before them, equal another sequence's
  holds the K/V that sequence would compute there. A block is published (found by its tokens) only
  once it is known finite: after a prefill chunk that wrote it, by a check of its K/V, or after a
  decode step of its sequence, which read it and gave finite logits. A freed published block stays
  findable until it is handed out again, least recently freed first;
- two blocks of a KVCache are never handed out: the null block 0, which the padding of block
  tables points to and nothing writes (it stays zero), and the sink block 1, where the padding of
  a static step (cuda_graph.py) writes its K/V and which no table holds;
- every slot a sequence may read holds a finite value unless that sequence wrote a non-finite one:
  the reference attention reads masked slots too (stale ones of its own blocks, the null block) and
  weighs them by 0, and 0 * inf or 0 * NaN is NaN. A table reaches only its own blocks and the null
  block (cuda_graph.DeviceBlockTables keeps no stale ids), so one request's NaN cannot reach
  another's attention; the pool starts zeroed and is zeroed again (`clear`) after a step that
  computed non-finite values, before its blocks go to other sequences (and forgets every
  published block).

Attention over pages has one readable PyTorch path (`paged_attention_reference`), the oracle of the
tests; on the CPU a pass reads the same padded layout kept current from the last pass instead of
gathering it again (kv_mirror.py), and on CUDA a fused kernel reads the pages where they are.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

NULL_BLOCK = 0   # block 0 of every KVCache: read as tables' padding, never written (see the invariants above)
SINK_BLOCK = 1   # block 1: the static step's padding writes here, no table holds it
RESERVED_BLOCKS = 2


class OutOfBlocks(Exception):
    """Raised by grow past the free blocks: a bug, since the scheduler asks can_grow first and
    preempts where it must."""


class BlockTable(list):
    """A sequence's block ids, in position order. `synced`: how many leading ids the device's copy
    of the table holds (cuda_graph.DeviceBlockTables), lowered when the table is truncated; `row`:
    its row there (None: none yet); `hashes`: with prefix caching, the keys of its leading full
    blocks of committed tokens (BlockAllocator.publish; a block whose key another block was
    published under first stays the sequence's own)."""
    __slots__ = ("synced", "row", "hashes")

    def __init__(self, ids=()):
        super().__init__(ids)
        self.synced, self.row, self.hashes = 0, None, []


def chain_seed(tokens: list[int], shift: int) -> bytes:
    """The parent key of a chain's first block: the first `shift` tokens (BlockAllocator.cached_prefix)."""
    return block_key(b"", tokens[:shift]) if shift else b""


def block_key(parent: bytes, tokens) -> bytes:
    """A full block's key: its tokens and (through the parent's key) every token before them. A
    SHA-256, as vLLM keys its prefix cache: two different prefixes never meet in practice."""
    return hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest()


class BlockAllocator:
    """Hands out block ids first_id .. first_id + num_blocks - 1 from a free queue. A block table
    is a list of ids (a BlockTable where the device keeps a copy), owned by its sequence.

    prefix_caching: full blocks of committed tokens are published under their key (block_key) and
    shared by reference count; `cached_prefix` finds the longest published prefix of a new
    sequence's tokens. A freed block goes to the back of the queue and keeps its key until it is
    handed out again from the front: the least recently freed is evicted first."""

    def __init__(self, num_blocks: int, block_size: int, first_id: int = 0, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks = OrderedDict.fromkeys(range(first_id, first_id + num_blocks))   # lowest id first
        self.refs: dict[int, int] = {}        # block id -> sequences holding it (held blocks only)
        self.published: dict[bytes, int] = {}   # key -> block id
        self.key_of: dict[int, bytes] = {}      # block id -> its key, while published

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (published ones among them: evicted when handed out)."""
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Make room for `num_tokens` positions in total."""
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed > self.num_free:
            raise OutOfBlocks(f"need {needed} blocks, {self.num_free} free")
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            # evicted (unpublished, if it was published): its K/V is about to be overwritten
            self.published.pop(self.key_of.pop(block, None), None)
            self.refs[block] = 1
            block_table.append(block)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Roll back to `num_tokens` positions: free the blocks wholly past them (last first, so a
        prefix's deepest blocks are evicted before its first)."""
        keep = self.blocks_for(num_tokens)
        while len(block_table) > keep:
            block = block_table.pop()
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                self.free_blocks[block] = None
        if isinstance(block_table, BlockTable):   # a later grow may put another id where a freed one was
            block_table.synced = min(block_table.synced, len(block_table))
            del block_table.hashes[keep:]

    def release(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)

    def cached_prefix(self, block_table: BlockTable, tokens: list[int], shift: int = 0) -> int:
        """Give an empty table the published blocks of the longest prefix of `tokens` (whole blocks
        only); returns how many positions they hold (0 without prefix caching). shift: position i
        holds what tokens[:i + 1 + shift] make (an EAGLE head's element i reads t_{i+1}): block j is
        keyed by tokens[shift + j * size:shift + (j + 1) * size], its chain seeded by tokens[:shift]."""
        if not self.prefix_caching:
            return 0
        key = chain_seed(tokens, shift)
        for start in range(shift, len(tokens) - self.block_size + 1, self.block_size):
            key = block_key(key, tokens[start:start + self.block_size])
            block = self.published.get(key)
            if block is None:
                break
            self.free_blocks.pop(block, None)   # a freed block, taken back
            self.refs[block] = self.refs.get(block, 0) + 1
            block_table.append(block)
            block_table.hashes.append(key)
        return len(block_table) * self.block_size

    def publish(self, block_table: BlockTable, tokens: list[int], num_tokens: int, shift: int = 0) -> None:
        """Publish the table's full blocks among its first `num_tokens` positions, whose K/V are
        those of `tokens` (committed, and known finite: see the top; shift as in cached_prefix). A
        block whose key is published already under another id stays the table's own."""
        if not self.prefix_caching:
            return
        size = self.block_size
        for i in range(len(block_table.hashes), num_tokens // size):   # shift: as in cached_prefix
            parent = block_table.hashes[-1] if block_table.hashes else chain_seed(tokens, shift)
            key = block_key(parent, tokens[shift + i * size:shift + (i + 1) * size])
            block_table.hashes.append(key)
            if key not in self.published and block_table[i] not in self.key_of:
                self.published[key], self.key_of[block_table[i]] = block_table[i], key

    def forget_published(self) -> None:
        """Unpublish every block (the pool was zeroed: KVCache.clear)."""
        self.published.clear()
        self.key_of.clear()


@dataclass(slots=True)
class AttentionMetadata:
    """Where the new tokens of one forward pass go, and what each of them may attend to.

    The batch is flattened: T new tokens from B sequences, sequence b owning the tokens
    query_start[b] : query_start[b + 1], at the positions context_lens[b] - q_len .. context_lens[b] - 1.
    """
    slot_mapping: torch.Tensor   # [T] cache slot written by each new token
    block_tables: torch.Tensor   # [B, max_blocks] block ids, padded with the null block 0 (masked)
    context_lens: torch.Tensor   # [B] tokens in the cache after this pass, new ones included
    query_start: torch.Tensor    # [B + 1] offsets of each sequence's new tokens in the flat batch
    token_seq: torch.Tensor      # [T] which sequence each new token belongs to
    positions: torch.Tensor      # [T] each new token's slot offset in its sequence: its position,
    # except in a tree, whose nodes' positions (their depths) are `rotary`
    # Derived once per pass and shared by every layer of the reference path:
    query_index: torch.Tensor    # [B, max_q] flat index of each sequence's i-th new token (padding: 0)
    query_valid: torch.Tensor    # [B, max_q] True where query_index is a real token
    extra: torch.Tensor | None = None   # [n] the rest of the step's one host-to-device copy (build_metadata)
    # A draft tree (tree.py): row b's tree nodes sit in the slots from base[b] on, R of them, and its
    # query i sees node j's key only where visible[b, i, j] (j is i's ancestor or i), its context as
    # usual: (base [B], visible [B, max_q, R]). None: causal.
    tree: tuple[torch.Tensor, torch.Tensor] | None = None
    rotary: torch.Tensor | None = None   # [T] a tree's positions for the rotary embedding (its depths)
    # Rows that attend together in the padded layout, from the host's lengths (query_runs; None: all).
    runs: list[tuple[int, int, int]] | None = None

    @property
    def rotary_positions(self) -> torch.Tensor:
        """Each new token's position for the rotary embedding: its slot's, or in a tree its depth's."""
        return self.positions if self.rotary is None else self.rotary
    # What every layer of the pass would otherwise derive again (masks, rotary tables, row indices):
    # built by the first layer that asks, shared by the others (once per pass, not once per layer).
    per_pass: dict = field(default_factory=dict)

    def once(self, key, make):
        if key not in self.per_pass:
            self.per_pass[key] = make()
        return self.per_pass[key]

    def attention_mask(self, block_size: int, group: int = 1,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, 1, group * max_q, max_k] True where a query may see a key: keys 0 .. its own position
        (causal, in context), and of a tree's new keys only its ancestors', repeated for the `group`
        query heads stacked along the query axis. With a dtype: the additive mask SDPA makes of the
        boolean one on every call (0 where True, -inf where False), made once here. The reference
        path's; the Triton kernel never asks."""
        def make():
            keys = torch.arange(self.block_tables.shape[1] * block_size, device=self.positions.device)
            query_pos = self.positions[self.query_index]   # [B, max_q]; padding: a real position
            visible = keys[None, None, :] <= query_pos[:, :, None]   # [B, max_q, max_k]
            if self.tree is not None:
                base, among_new = self.tree
                offset = keys[None, :] - base[:, None]   # [B, max_k]: a key's node, where it is new
                new = (offset >= 0) & (offset < among_new.shape[2])
                node = offset.clamp(0, among_new.shape[2] - 1)[:, None, :].expand_as(visible)
                visible = torch.where(new[:, None, :], among_new.gather(2, node), visible)
            visible = visible[:, None].repeat(1, 1, group, 1)
            return visible if dtype is None else torch.where(visible, 0.0, float("-inf")).to(dtype)
        return self.once(("mask", block_size, group, dtype), make)

    def full(self) -> bool:
        """Every sequence adds max_q tokens: the padded [B, max_q] layout is the flat one (known from
        shapes, no sync)."""
        return len(self.positions) == self.query_index.numel()

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] in the padded layout [B * max_q, ...] (padding rows repeat token 0)."""
        return x if self.full() else x[self.query_index.flatten()]

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: x [B * max_q, ...] back to the real tokens [T, ...] in flat order. The rows are
        computed from the lengths (no boolean mask: that would sync with the host on CUDA)."""
        if self.full():
            return x
        max_q = self.query_index.shape[1]
        rows = self.once("rows", lambda: self.token_seq * max_q + torch.arange(
            len(self.token_seq), device=self.token_seq.device) - self.query_start[self.token_seq])
        return x[rows]


@dataclass(frozen=True)
class MetadataShape:
    """What the host knows of a packed metadata buffer, so the device derives it without a sync."""
    batch: int
    max_blocks: int
    total: int            # new tokens in all
    max_q: int            # most new tokens of one sequence
    extra: int            # ints after the block tables


def pack_metadata(block_tables: list[list[int]] | None, num_cached: list[int], query_lens: list[int],
                  extra: list[int] = ()) -> tuple[list[int], MetadataShape]:
    """The host's part of build_metadata: the ints to send (lengths, block tables padded with the
    null block unless they are on the device already (None), `extra`) and their shape."""
    max_blocks = max(len(t) for t in block_tables) if block_tables is not None else 0
    tables = (b for t in block_tables or () for b in (*t, *[NULL_BLOCK] * (max_blocks - len(t))))
    host = [*num_cached, *query_lens, *tables, *extra]
    return host, MetadataShape(len(query_lens), max_blocks, sum(query_lens), max(query_lens), len(extra))


def upload(host: list[int], device: torch.device) -> torch.Tensor:
    """Ints (a list, or an int64 array) to the device in one copy, pinned and non-blocking on CUDA."""
    packed = torch.tensor(host, dtype=torch.int64)
    if device.type == "cuda":
        packed = packed.pin_memory()
    return packed.to(device, non_blocking=True)


def build_metadata(block_tables: list[list[int]], num_cached: list[int], query_lens: list[int],
                   block_size: int, device: torch.device, extra: list[int] = ()) -> AttentionMetadata:
    """Metadata for sequences that each add query_lens[b] tokens after num_cached[b] cached ones.

    The host sends one int64 buffer (the block tables, the lengths and `extra`, whatever else the
    step needs from the host: meta.extra on the device) in one copy; everything else is derived on
    the device from it (derive_metadata)."""
    host, shape = pack_metadata(block_tables, num_cached, query_lens, extra)
    meta = derive_metadata(upload(host, device), shape, block_size)
    meta.runs = query_runs(query_lens)
    return meta


def derive_metadata(packed: torch.Tensor, shape: MetadataShape, block_size: int,
                    tables: torch.Tensor | None = None) -> AttentionMetadata:
    """The metadata from a packed buffer on the device, without a sync (the shapes come from the
    host); `tables`: the block tables [B, max_blocks] where they are on the device already."""
    batch, start = shape.batch, shape.batch * (2 + shape.max_blocks)   # start: where extra begins
    cached, lens = packed[:batch], packed[batch:2 * batch]
    if tables is None:
        tables = packed[2 * batch:start].view(batch, shape.max_blocks)
    meta = ragged_metadata(tables, cached, lens, shape.total, shape.max_q, block_size)
    meta.extra = packed[start:start + shape.extra]
    return meta


def ragged_metadata(tables: torch.Tensor, cached: torch.Tensor, lens: torch.Tensor, total: int, max_q: int,
                    block_size: int, padding_rows: bool = False) -> AttentionMetadata:
    """Metadata for sequences b that each add lens[b] tokens after cached[b] cached ones, over
    tables [B, max_blocks] on the device; total (their sum) and max_q (their max) come from the
    host, so nothing syncs. padding_rows: some rows are a static step's padding, on the null block,
    and write to the sink instead."""
    batch, device = len(lens), lens.device
    query_start = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    token_seq = torch.repeat_interleave(torch.arange(batch, device=device), lens, output_size=total)
    positions = cached[token_seq] + torch.arange(total, device=device) - query_start[token_seq]
    blocks = tables[token_seq, positions // block_size]
    offsets = torch.arange(max_q, device=device)
    query_valid = offsets[None, :] < lens[:, None]
    slots = blocks * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=padding_to_sink(blocks, slots, block_size) if padding_rows else slots,
        block_tables=tables, context_lens=cached + lens, query_start=query_start, token_seq=token_seq,
        positions=positions, query_valid=query_valid,
        query_index=torch.where(query_valid, query_start[:-1, None] + offsets[None, :], 0))


def padding_to_sink(blocks: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """slots, except that a slot in the null block (a padding row's) goes to the sink block."""
    return torch.where(blocks == NULL_BLOCK, SINK_BLOCK * block_size + slots % block_size, slots)


def padded_metadata(tables: torch.Tensor, cached: torch.Tensor, num_new: torch.Tensor, q_len: int,
                    block_size: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata of q_len queries per row over tables [B, max_blocks] already on the device (nothing
    from the host): row b's num_new[b] new tokens at positions cached[b] .. cached[b] + num_new[b] - 1,
    then padding queries that repeat its last real position (so they see the same keys) and write
    their K/V to the sink block; a static step's padding rows (on the null block) write there too.
    Also returns each query's real offset [B, q_len] (clamped to the last real one): where a row's
    logits are read. With q_len 1 and num_new 1: one decode token per row (a draft round's steps)."""
    batch, device = len(cached), cached.device
    offsets = torch.arange(q_len, device=device)
    real_offsets = torch.minimum(offsets[None, :], (num_new[:, None] - 1).clamp(min=0))  # [B, q_len]
    positions = cached[:, None] + real_offsets
    blocks = tables.gather(1, positions // block_size)
    # padding rows' slots to the sink, then padding queries'
    slots = padding_to_sink(blocks, blocks * block_size + positions % block_size, block_size)
    slots = torch.where(offsets[None, :] < num_new[:, None], slots,
                        SINK_BLOCK * block_size + offsets % block_size)
    flat = torch.arange(batch * q_len, device=device)
    meta = AttentionMetadata(
        slot_mapping=slots.flatten(), block_tables=tables, context_lens=cached + num_new,
        query_start=torch.arange(batch + 1, device=device) * q_len, token_seq=flat // q_len,
        positions=positions.flatten(), query_index=flat.view(batch, q_len),
        query_valid=torch.ones(batch, q_len, dtype=torch.bool, device=device))
    return meta, real_offsets


class KVCache:
    """The pool of K/V pages for every layer of one model: num_blocks blocks to hand out, ids
    2 .. num_blocks + 1, after the null block 0 and the sink block 1."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, prefix_caching: bool = False,
                 use_mirror: bool = True):
        self.block_size = block_size
        self.pool = torch.zeros(num_layers, 2, RESERVED_BLOCKS + num_blocks, block_size, num_kv_heads,
                                head_dim, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, block_size, first_id=RESERVED_BLOCKS,
                                        prefix_caching=prefix_caching)
        self.mirror = None   # the CPU attention's copy of the pages in its padded layout (kv_mirror.py)
        self.use_mirror = use_mirror   # off: the CPU takes the reference attention, as CUDA's layout

    def empty_like(self, num_blocks: int) -> "KVCache":
        """An empty pool of num_blocks for the same model (another engine over it), prefix caching and
        mirror as this one."""
        num_layers, _, _, block_size, num_kv_heads, head_dim = self.pool.shape
        return KVCache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, self.pool.dtype,
                       self.pool.device, self.allocator.prefix_caching, self.use_mirror)

    def clear(self) -> None:
        """Zero every slot and unpublish every block (see the module's invariants); which blocks
        each sequence holds is left as it is."""
        self.pool.zero_()
        self.allocator.forget_published()
        self.mirror = None   # it held what the pool held

    def zero_blocks(self, blocks: torch.Tensor) -> None:
        """Zero these blocks in every layer (K/V a pass wrote that are not finite)."""
        self.pool[:, :, blocks] = 0
        self.mirror = None   # written outside a pass: the mirror cannot tell

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Slot src[i]'s K/V to slot dst[i] in every layer (a tree step's accepted path): all read,
        then all written. The mirror re-reads the blocks written (kv_mirror's versions)."""
        pool = self.pool.view(*self.pool.shape[:2], -1, *self.pool.shape[4:])   # [layers, 2, slots, kv_h, hd]
        to = torch.tensor(dst, device=self.pool.device)
        pool[:, :, to] = pool[:, :, torch.tensor(src, device=self.pool.device)]
        if self.mirror is not None:
            self.mirror.versions[to.cpu().numpy() // self.block_size] += 1

    def layer(self, i: int) -> torch.Tensor:
        """Layer i's pages [2 (k/v), num_blocks, block_size, kv_heads, head_dim]: K at [0], V at [1]."""
        return self.pool[i]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) in their slots."""
    k_cache.view(-1, *k.shape[1:])[slot_mapping] = k
    v_cache.view(-1, *v.shape[1:])[slot_mapping] = v


RUN_SPLIT = 64   # padded queries past which rows attend in runs of their own (query_runs)


def paged_attention_reference(q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """Causal attention (in a draft tree, its mask) of the new tokens q [T, heads, head_dim] over their
    sequences' pages, kv [2 (k/v), num_blocks, block_size, kv_heads, head_dim] (KVCache.layer).

    Gathers each sequence's pages into a padded [B, max_k] layout and attends over it
    (padded_attention). On the CPU a pass keeps that layout from the last one instead (kv_mirror.py).
    """
    _, _, block_size, kv_heads, head_dim = kv.shape
    batch = meta.block_tables.shape[0]
    # K and V in one gather of every sequence's slots (their index made once per pass), each head's
    # keys laid out contiguously, as SDPA reads them (strided keys cost it a copy of its own)
    slots = meta.once(("slots", block_size), lambda: (
        meta.block_tables[:, :, None] * block_size + torch.arange(block_size, device=q.device)).flatten())
    keys, values = (kv.view(2, -1, kv_heads, head_dim).transpose(1, 2).index_select(2, slots)
                    .view(2, kv_heads, batch, -1, head_dim).transpose(1, 2))   # each [B, kv_heads, max_k, hd]
    return padded_attention(q, keys, values, meta, scale, block_size)


def padded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata,
                     scale: float, block_size: int) -> torch.Tensor:
    """Causal attention (in a draft tree, its mask: meta.attention_mask) of the new tokens q [T, heads,
    head_dim] over their sequences' keys and values in the padded layout, each [B, kv_heads, max_k,
    head_dim] (key i of row b: position i, past the context masked): one masked softmax attention per
    K/V head. Grouped-query attention without copying K/V per query head: the `group` query heads that
    share a K/V head are stacked along the query axis instead. Runs of rows whose query counts differ
    widely (decode rows beside a prefill chunk: a mixed step; meta.runs) attend apart, each padded to
    its own longest row only."""
    batch, kv_heads, _, head_dim = keys.shape
    group = q.shape[1] // kv_heads
    max_q = meta.query_index.shape[1]
    queries = meta.padded(q).view(batch, max_q, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    mask = meta.attention_mask(block_size, group, q.dtype)   # [B, 1, group * max_q, max_k], additive
    if not meta.runs or len(meta.runs) == 1:
        out = attend(queries, keys, values, mask, scale)
    else:
        out = q.new_empty(batch, max_q, kv_heads, group, head_dim)
        mask = mask.view(batch, 1, group, max_q, -1)
        for start, end, n in meta.runs:   # rows start .. end - 1, their first n queries
            run_mask = mask[start:end, :, :, :n].reshape(end - start, 1, group * n, -1)
            out[start:end, :n] = attend(queries[start:end, :, :, :n], keys[start:end], values[start:end],
                                        run_mask, scale)
    return meta.unpadded(out.reshape(batch * max_q, kv_heads * group, head_dim))   # [T, heads, hd], flat


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor:
    """SDPA of queries [B, kv_heads, group, n, hd] (the group's heads stacked along the query axis)
    under mask [B, 1, group * n, max_k]; [B, n, kv_heads, group, hd]."""
    batch, kv_heads, group, n, head_dim = queries.shape
    out = F.scaled_dot_product_attention(queries.reshape(batch, kv_heads, group * n, head_dim), keys, values,
                                         attn_mask=mask, scale=scale)
    return out.view(batch, kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)


def query_runs(lens: list[int]) -> list[tuple[int, int, int]]:
    """Rows of lens[b] queries as runs (first row, end, longest), each attended apart. A row starts a
    new run where padding it and the run so far to one length would compute RUN_SPLIT or more queries
    that are padding: decode rows (1 + K queries) beside a prefill chunk. Made from the host's counts
    (reading the device's would sync), and only where a pass is not captured in a graph (a graph would
    keep one pass's runs for every replay)."""
    runs, start, longest = [], 0, lens[0]
    for b, n in enumerate(lens[1:], 1):
        wasted = (b - start) * max(0, n - longest) + max(0, longest - n)
        if wasted >= RUN_SPLIT:
            runs.append((start, b, longest))
            start, longest = b, n
        longest = max(longest, n)
    return runs + [(start, len(lens), longest)]
