"""Sampling without host syncs: each row of a batch has its own temperature, top-k, top-p and seed.

Three ideas keep it exact, batched, reproducible and sync-free:
- `target_probs` turns logits into the exact distribution a request samples from (temperature,
  then top-k, then top-p on what top-k kept, renormalized); greedy rows (T = 0) become one-hot on
  the argmax, so greedy and sampled rows share every later step. A row that truncates nothing keeps
  its softmax bit for bit, whatever the other rows do.
- a token is drawn by inverting the cumulative distribution: the first index whose cumulative
  weight exceeds u * total, for one uniform u per draw (`pick`). The weights need not be
  normalized, which lets the rejection sampler draw from max(p - q, 0) directly. The sum is taken in
  float64 and u has 52 bits, so a token of probability 1e-12 is still drawn at its probability,
  and a token of weight 0 never is (it adds nothing to the sum: no u lands on it).
- randomness is counter-based: u for (seed, position, stream) is a hash of those numbers, like
  Philox. A request's draws therefore do not depend on which other requests share its batch, or
  on preemption and recompute, and need no generator state.

Noise streams (one draw per stream per token position, so no draw is ever reused):
  EMIT   the token the target emits at a position: plain sampling, recovered and bonus tokens
         (so speculation with K = 0 is exactly plain sampling);
  ACCEPT the uniform of the acceptance test of the draft token at a position;
  DRAFT  the draft model's own draw of the token at a position.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
EMIT, ACCEPT, DRAFT = 0, 1, 2
NOISE_BITS = 52


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in int64 without overflow (split x in 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32"); a bijection of 32 bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _fold(h: torch.Tensor, x) -> torch.Tensor:
    """Hash a counter x into the state h. For a fixed h it is a bijection of x (two positions of one
    request never collide); h enters twice, so that states which differ only in low bits do not
    map one request's counters onto another's (h ^ x alone would: h ^ x == h' ^ x')."""
    return _mix32((_mix32(h ^ x) + h) & MASK32)


def _counter_hash(seeds: torch.Tensor, positions: torch.Tensor, stream: int, key: int) -> torch.Tensor:
    """32 bits, a pure function of (key, seed, position, stream): a chain that folds in each counter."""
    h = _mix32((seeds & MASK32) ^ key)
    h = _fold(h, (seeds >> 32) & MASK32)
    h = _fold(h, positions & MASK32)
    return _fold(h, stream)


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """52 random bits -> float64 strictly inside (0, 1): (bits + 1/2) / 2^52 is exact in float64
    (53 significant bits), from 2^-53 to 1 - 2^-53: never 0, never 1."""
    return (bits.double() + 0.5) * 2.0 ** -NOISE_BITS


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform (0, 1) float64 [N], a pure function of (seed, position, stream); seeds, positions:
    [N] int64. `stream` separates independent uses at one position (acceptance test, draws).
    Two independently keyed 32-bit chains give the 52 bits."""
    hi = _counter_hash(seeds, positions, stream, key=0x9E3779B9)
    lo = _counter_hash(seeds, positions, stream, key=0x85EBCA6B)
    return unit_interval((hi << (NOISE_BITS - 32)) | (lo >> (64 - NOISE_BITS)))


def pick(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw an index per row of weights [N, V] (>= 0, not necessarily normalized) by the inverse
    CDF: the first index i with cdf[i] > u * total. u: [N] uniforms in (0, 1) -> [N], or [N, M]
    -> [N, M] (M draws from each row). Index i is drawn with probability weights[i] / total."""
    cdf = weights.double().cumsum(-1)                                        # [N, V]
    total = cdf[:, -1:]
    # x < total, even where u * total rounds up to it, so the index exists and is <= the last
    # positive weight. cdf[i - 1] <= x < cdf[i] means cdf grew at i: weights[i] > 0.
    x = torch.minimum(u.view(len(weights), -1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, x, right=True).clamp(max=weights.shape[-1] - 1)
    # A cumulative sum that is not flat over a zero weight (a parallel scan may round so) must
    # still not pick it: fall back to the argmax, a positive weight.
    idx = torch.where(weights.gather(-1, idx) > 0, idx, weights.argmax(-1, keepdim=True))
    return idx.view(u.shape)


@dataclass(frozen=True)
class Truncation:
    """What a batch's top-k / top-p need, known on the host: its largest top_k (0: none), whether
    any row uses top-p, and whether every row that uses top-p also has a top_k. Truncating ranks a
    row's tokens: only the largest few (truncate_top_k_top_p) where each truncating row has a top_k,
    or, on a CPU, where the few hold what top-p keeps; else the whole vocabulary, a sort of every
    row's logits (its cost: docs/sampling.md)."""
    top_k: int
    top_p: bool
    top_p_within_top_k: bool = False


@dataclass
class SamplingBatch:
    """The sampling parameters of a batch's requests, on the device."""
    temperature: torch.Tensor    # [B] float, 0 = greedy
    top_k: torch.Tensor          # [B] int64, 0 = off
    top_p: torch.Tensor          # [B] float
    seeds: torch.Tensor          # [B] int64
    greedy: bool                 # every request is greedy
    truncate: Truncation | bool  # False: no request uses top-k or top-p


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, truncate: Truncation | bool = True) -> torch.Tensor:
    """The distribution each row samples from. logits: [N, V]; temperature, top_p: [N] float;
    top_k: [N] int (0 = off). Greedy rows (temperature 0) become one-hot on the argmax.
    truncate: False skips top-k/top-p (the caller knows no row uses them), a Truncation says what
    the rows use, True: anything. Rows that use neither come out the same every way."""
    vocab = logits.shape[-1]
    logits = logits.float()
    greedy = temperature == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    # scatter, not F.one_hot, which may check its indices on the host (a sync a CUDA graph cannot hold)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if truncate:
        limits = truncate if isinstance(truncate, Truncation) else Truncation(vocab, True)
        # A row that truncates nothing keeps its softmax bit for bit (no renormalization by a sum
        # that is 1 only up to rounding): its draws must not depend on whether another row truncates.
        # (A greedy row's truncation is thrown away below: at top_p 1 it ranks no more candidates.)
        probs = torch.where(((top_k > 0) | (top_p < 1))[:, None], truncate_top_k_top_p(
            probs, logits, top_k, torch.where(greedy, 1.0, top_p), limits), probs)
    return torch.where(greedy[:, None], one_hot, probs)


def renormalize(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """probs [N, V] where keep, 0 elsewhere, divided by the kept mass. The mass is the end of a
    scan, not a sum: a reduction over one long row is split across threads differently depending
    on how many rows the batch has; a scan runs each row in order, so a row's result is its own."""
    kept = torch.where(keep, probs.double(), 0.0)
    return (kept / kept.cumsum(-1)[:, -1:]).float()


def ranked(logits: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Each row's token ids by descending logit, stably (ties in id order, so rank 0 is
    logits.argmax(), even where distinct logits round to one probability): all of them, a sort over
    the vocabulary, or only the first k, two topk."""
    if k is None:
        return logits.argsort(dim=-1, descending=True, stable=True)
    values, ids = logits.topk(k, dim=-1)   # the k largest, but of the ties at the k-th logit any
    kth = values[:, -1:]
    ties = (values == kth).sum(-1, keepdim=True)   # how many the k hold (they come last: values descend)
    # those the stable sort holds: the first by id of the tokens at the k-th logit
    minus_id = -torch.arange(logits.shape[-1], device=logits.device, dtype=logits.dtype)   # exact below 2^24
    first_tied = torch.where(logits == kth, minus_id, float("-inf")).topk(k, dim=-1).indices
    rank = torch.arange(k, device=logits.device)[None, :]
    ids = torch.where(rank < k - ties, ids, first_tied.gather(-1, (rank - (k - ties)).clamp(min=0)))
    ids = ids.sort(dim=-1).values   # then ranked stably: ties in id order
    return ids.gather(-1, logits.gather(-1, ids).argsort(dim=-1, descending=True, stable=True))


def top_p_keeps(mass_before: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p keeps a token while the mass before it is < top_p, and always the most likely (its mass
    before is exactly 0: kept even where a top_p as small as 1e-300 rounds to 0 in float32, as vLLM
    keeps it). top_p = 1 keeps everything: the mass before a tail token can round to 1."""
    return (mass_before < top_p[:, None]) | (mass_before == 0) | (top_p[:, None] >= 1)


FEW_CANDIDATES = 64   # the first candidates of a top-p row without top-k (8x more while its last one is kept)


def truncate_top_k_top_p(probs: torch.Tensor, logits: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor, limits: Truncation) -> torch.Tensor:
    """probs [N, V] cut to the top_k most likely, then to the top_p of what is left, renormalized.

    Ranking a row is a sort over the vocabulary, yet a row keeps at most its top_k, and top-p alone
    only the tokens before the mass reaches top_p: where the largest few hold them, only those
    candidates are ranked (a top-p row without top-k, on a CPU: 8x more while its last candidate is
    kept, and all past vocab / 16, where growing costs more than the sort; the check reads the
    device). Every sum runs in order over ranks or ids (the masses top-p measures against, like
    renormalize's, in id order), so on a CPU, whose scans run in order, a row's probabilities are
    the same bit for bit whatever was ranked (a CUDA scan's grouping follows the row's length)."""
    vocab = probs.shape[-1]
    without_top_k = limits.top_p and not limits.top_p_within_top_k
    size = max(limits.top_k, FEW_CANDIDATES if without_top_k else 0)   # None: the whole vocabulary
    if not 0 < size <= vocab // 2 or (without_top_k and not probs.is_cpu):
        size = None
    # a top-p row without top-k measures against its whole row's mass, which the candidates' falls short of
    whole = probs.double().cumsum(-1)[:, -1:] if without_top_k and size is not None else None
    while True:
        order = ranked(logits, size)   # [N, vocab or size]
        if size is None:   # rank -> id: a scatter over the vocabulary
            ids, by_id = None, lambda x: torch.zeros(probs.shape, dtype=x.dtype, device=x.device).scatter(
                -1, order, x)
        else:   # the candidates in id order
            ids, at = order.sort(dim=-1)
            by_id = lambda x: x.gather(-1, at)   # noqa: E731
        row_probs = probs if ids is None else probs.gather(-1, ids)   # by id
        rank = torch.arange(order.shape[-1], device=probs.device)[None, :]
        in_top_k = rank < torch.where(top_k > 0, top_k, vocab)[:, None]
        top_k_mass = torch.where(by_id(in_top_k), row_probs.double(), 0.0).cumsum(-1)[:, -1:]
        mass = (top_k_mass if ids is None or whole is None
                else torch.where((top_k > 0)[:, None], top_k_mass, whole))
        kept = probs.gather(-1, order).double() * in_top_k
        mass_before = (kept.cumsum(-1) - kept) / mass              # renormalized over what top-k kept
        keep = in_top_k & top_p_keeps(mass_before, top_p)
        # enough candidates: every top-p row without top-k cut before its last one (mass only grows)
        if size is None or not without_top_k or bool(((top_k > 0) | (top_p >= 1) | ~keep[:, -1]).all()):
            break
        size = size * 8 if size * 8 <= vocab // 16 else None
    kept_probs = renormalize(row_probs, by_id(keep))
    return kept_probs if ids is None else torch.zeros_like(probs).scatter(-1, ids, kept_probs)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, truncate: Truncation | bool = True) -> torch.Tensor:
    """One token per row of logits [N, V], for the request at `positions` (the index of the new token)."""
    probs = target_probs(logits, temperature, top_k, top_p, truncate)
    return pick(probs, uniform_noise(seeds, positions, EMIT))


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for a draft d drawn from q (so q(d) > 0; one-hot drafts have q(d) = 1);
    0 where q(d) = 0, a draft q could not have drawn."""
    p_draft, q_draft = p_draft.double(), q_draft.double()
    return torch.where(q_draft > 0, p_draft / q_draft, 0.0).clamp(max=1.0)


def next_token_weights(p_next: torch.Tensor, q_next: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Unnormalized weights [B, V] of the token emitted after the accepted drafts: after a rejection
    the residual max(p - q, 0) (the mass p has beyond what accepting q's draft already gave it),
    else p itself (the bonus token)."""
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    # A rejection has probability 0 when p == q; only rounding can get here with an all-zero residual.
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     truncate: Truncation | bool = True):
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a batch, each row with its own K.

    target_logits  [B, K+1, V]  row i: the target's logits for the token after [last, d_1 .. d_i]
    draft_ids      [B, K]       the proposed tokens d_1 .. d_K (past num_draft[b]: ignored)
    draft_probs    [B, K, V]    q, the draft's distributions after the same temperature/top-k/top-p;
                                None for drafts without probabilities (n-gram, greedy): q is one-hot
    num_draft      [B]          request b's own K (0 .. K)
    positions      [B]          token position of d_1 (the request's current length)
    Returns tokens [B, K+1] and num_accepted [B]: a request's output is tokens[b, :num_accepted[b] + 1].

    Why the output has exactly the target's distribution p: d ~ q is kept with probability
    min(1, p(d)/q(d)), so token x comes out accepted with probability min(q(x), p(x)); a rejection
    happens with probability 1 - sum_x min(p, q) = sum_x max(p - q, 0), and then x is drawn from
    normalize(max(p - q, 0)); the two add up to p(x). When all K drafts are accepted, the target's
    logits at position K+1 are already computed, so the bonus token drawn from p costs nothing.
    Greedy rows (T = 0) have one-hot p: accept while d equals the argmax, then emit the argmax.
    """
    batch, k_plus_1, vocab = target_logits.shape
    k = k_plus_1 - 1
    rows = lambda x: x.repeat_interleave(k_plus_1)
    p = target_probs(target_logits.reshape(-1, vocab), rows(temperature), rows(top_k), rows(top_p),
                     truncate).view(batch, k_plus_1, vocab)
    if draft_probs is None or k == 0:
        return verify_one_hot(p, draft_ids, num_draft, seeds, positions)
    q = draft_probs
    # 1. Accept d_i with probability min(1, p(d_i) / q(d_i)).
    p_draft = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)   # [B, K]
    q_draft = q.gather(-1, draft_ids[..., None]).squeeze(-1)          # [B, K]
    offsets = torch.arange(k, device=draft_ids.device)
    u = uniform_noise(seeds.repeat_interleave(k), (positions[:, None] + offsets).flatten(), ACCEPT)
    accepted = (u.view(batch, k) < acceptance_probability(p_draft, q_draft)) & (offsets < num_draft[:, None])
    num_accepted = accepted.long().cumprod(-1).sum(-1)   # [B], the length of the accepted prefix
    # 2. One more token at index n = num_accepted: recovered after a rejection, bonus otherwise.
    n = num_accepted[:, None, None].expand(-1, 1, vocab)
    p_next = p.gather(1, n).squeeze(1)                    # [B, V]
    q_next = q.gather(1, n.clamp(max=k - 1)).squeeze(1)   # [B, V]; unused where n = K (nothing rejected)
    weights = next_token_weights(p_next, q_next, rejected=num_accepted < num_draft)
    next_token = pick(weights, uniform_noise(seeds, positions + num_accepted, EMIT))
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1).scatter(1, num_accepted[:, None],
                                                                     next_token[:, None])
    return tokens, num_accepted


def verify_one_hot(p: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor, seeds: torch.Tensor,
                   positions: torch.Tensor):
    """rejection_sample for drafts without probabilities (n-gram, greedy drafts: q one-hot on d),
    p: [B, K+1, V]. Draw the target's own token t_i ~ p_i at every position, with the EMIT noise of
    that position (what plain sampling draws there), and accept d_i while it equals t_i. That is the
    rule above: d is accepted with probability p(d) = min(1, p(d) / q(d)), and after a rejection t is
    p given t != d, i.e. normalize(max(p - q, 0)). Drawn this way the output is the plain sampler's,
    token for token, whatever the drafts and K."""
    batch, k_plus_1, vocab = p.shape
    offsets = torch.arange(k_plus_1, device=p.device)
    u = uniform_noise(seeds.repeat_interleave(k_plus_1), (positions[:, None] + offsets).flatten(), EMIT)
    return verify_greedy(pick(p.reshape(-1, vocab), u).view(batch, k_plus_1), draft_ids, num_draft)


def verify_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor):
    """Accept each request's drafts while they equal the target's own tokens target_ids [B, K+1];
    the outputs are target_ids. For a batch where every request is greedy these are the argmaxes
    (no softmax, nothing over the vocabulary here)."""
    k = draft_ids.shape[1]
    offsets = torch.arange(k, device=draft_ids.device)
    match = (draft_ids == target_ids[:, :k]) & (offsets[None, :] < num_draft[:, None])
    return target_ids, match.long().cumprod(-1).sum(-1)


class Sampler:
    """`rejection_sample` (which, with K = 0, is plain sampling) and `verify_greedy`, with
    rejection_sample torch.compile'd where that pays (CUDA by default), eager otherwise.

    What is compiled, and why only that: a sampled step of a batch (softmax, truncation, float64
    scans over [rows, vocab]), where fusion saves whole passes over the vocabulary and, in an eager
    step, many launches. Not verify_greedy (an argmax's compare over [batch, K]: nothing to fuse),
    and not a batch of 1 (its tensors are small, and inside a CUDA graph it launches nothing from
    Python anyway). Every step runs under inference mode, so no variant is compiled twice for grad.

    Compiled for the shapes a decode step has: K static (a step, and its CUDA graph, is per K) and
    the batch dynamic (one compiled kernel serves every bucket). That is at most 4 x (max_k + 1)
    variants (with and without draft probabilities, with and without truncation), within the
    recompile limit set here; if a step ever meets more, it raises instead of running eagerly
    without a word (dynamo's default)."""

    def __init__(self, compile: bool, max_k: int = 16, backend: str = "inductor"):
        self.compiled = compile
        self.recompile_limit = 4 * (max_k + 1)
        self.verify_greedy = verify_greedy
        self.rejection_sample = (compiled_for_batches(rejection_sample, backend, self.recompile_limit)
                                 if compile else rejection_sample)


@functools.cache   # one per process: engines (an LLM's, its twins, other LLMs) share what is compiled
def compiled_for_batches(fn, backend: str, recompile_limit: int):
    """fn compiled with its batch (the first dimension of every tensor argument) dynamic, called
    eagerly for a batch of 1; raising when it would be compiled more than recompile_limit times."""
    compiled = torch.compile(fn, dynamic=False, backend=backend)

    def call(*args):
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor) and arg.dim()]
        if tensors[0].shape[0] == 1:
            return fn(*args)
        for arg in tensors:   # every tensor argument is batch-first
            torch._dynamo.mark_dynamic(arg, 0)
        with torch._dynamo.config.patch(recompile_limit=recompile_limit, fail_on_recompile_limit_hit=True,
                                        accumulated_recompile_limit=max(256, 4 * recompile_limit)):
            return compiled(*args)
    return call
