"""Sampling without host syncs: each row of a batch has its own temperature, top-k, top-p and seed.

Two ideas keep it batched, reproducible and sync-free:
- `target_probs` turns logits into the exact distribution a request samples from (temperature,
  then top-k, then top-p on what top-k kept, renormalized); greedy rows (T = 0) become one-hot on
  the argmax, so greedy and sampled rows share every later step.
- randomness is counter-based: the uniform noise for (seed, position, stream, vocab index) is a
  hash of those numbers, like Philox. A request's draws therefore do not depend on which other
  requests share its batch, or on preemption and recompute, and need no generator state.
A token is drawn by the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent,
which picks i with probability p_i / sum(p) (the "Gumbel-max" trick in another dress). The weights
need not be normalized, which lets the rejection sampler race over max(p - q, 0) directly.

Noise streams (one draw per stream per token position, so no draw is ever reused):
  EMIT   the token the target emits at a position: plain sampling, recovered and bonus tokens
         (so speculation with K = 0 is exactly plain sampling);
  ACCEPT the uniform of the acceptance test of the draft token at a position;
  DRAFT  the draft model's own draw of the token at a position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MASK32 = 0xFFFFFFFF
EMIT, ACCEPT, DRAFT = 0, 1, 2


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, in int64 without overflow (split x in 16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32")."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int, size: int) -> torch.Tensor:
    """Uniform (0, 1) floats [N, size], a pure function of (seed, position, stream, column).

    seeds, positions: [N] int64. `stream` separates independent uses at one position (the
    acceptance test, the recovered token, the bonus token)."""
    # A chain, not a symmetric combination: hash(seed), then fold in each counter in turn.
    row = _mix32((seeds & MASK32) + 0x9E3779B9)
    row = _mix32(row ^ ((seeds >> 32) & MASK32))
    row = _mix32(row ^ (positions & MASK32))
    row = _mix32(row ^ stream)
    cols = torch.arange(size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(_mix32(row[:, None] ^ cols[None, :]))
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingBatch:
    """The sampling parameters of a batch's requests, on the device."""
    temperature: torch.Tensor    # [B] float, 0 = greedy
    top_k: torch.Tensor          # [B] int64, 0 = off
    top_p: torch.Tensor          # [B] float
    seeds: torch.Tensor          # [B] int64
    greedy: bool                 # every request is greedy
    truncate: bool               # some request uses top-k or top-p

    @classmethod
    def of(cls, requests, device: torch.device) -> "SamplingBatch":
        params = [r.params for r in requests]
        tensor = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=device)
        return cls(tensor([p.temperature for p in params], torch.float32), tensor([p.top_k for p in params], torch.int64),
                   tensor([p.top_p for p in params], torch.float32), tensor([r.seed for r in requests], torch.int64),
                   greedy=all(p.temperature == 0 for p in params),
                   truncate=any(p.top_k or p.top_p < 1 for p in params))


def target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """The distribution each row samples from. logits: [N, V]; temperature, top_p: [N] float;
    top_k: [N] int (0 = off). Greedy rows (temperature 0) become one-hot on the argmax.
    truncate=False skips top-k/top-p (the caller knows no row uses them: saves a sort)."""
    vocab = logits.shape[-1]
    greedy = temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(probs.dtype)
    if not truncate:
        return torch.where(greedy[:, None], one_hot, probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    in_top_k = rank < torch.where(top_k > 0, top_k, vocab)[:, None]
    kept = sorted_probs * in_top_k
    # top-p over what top-k kept: keep a token while the (renormalized) mass before it is < top_p,
    # so the most likely token is always kept.
    mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
    keep_sorted = in_top_k & (mass_before < top_p[:, None])
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.where(greedy[:, None], one_hot, probs)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Draw one index per row from probs [N, V] using uniform noise [N, V]: argmax p / Exp(1)."""
    return (probs / -torch.log(noise)).argmax(-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, truncate: bool = True) -> torch.Tensor:
    """One token per row of logits [N, V], for the request at `positions` (the index of the new token)."""
    probs = target_probs(logits, temperature, top_k, top_p, truncate)
    return race(probs, uniform_noise(seeds, positions, stream=EMIT, size=logits.shape[-1]))


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for a draft d drawn from q (so q(d) > 0; one-hot drafts have q(d) = 1)."""
    return (p_draft / q_draft).clamp(max=1.0)


def next_token_weights(p_next: torch.Tensor, q_next: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Unnormalized weights [B, V] of the token emitted after the accepted drafts: after a rejection
    the residual max(p - q, 0) (the mass p has beyond what accepting q's draft already gave it),
    else p itself (the bonus token)."""
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp(min=0), p_next)
    # A rejection has probability 0 when p == q; only rounding can get here with an all-zero residual.
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     num_draft: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     seeds: torch.Tensor, positions: torch.Tensor, truncate: bool = True):
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
    q = draft_probs if draft_probs is not None else F.one_hot(draft_ids, vocab).to(p.dtype)
    # 1. Accept d_i with probability min(1, p(d_i) / q(d_i)).
    p_draft = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)                         # [B, K]
    q_draft = q.gather(-1, draft_ids[..., None]).squeeze(-1)                                # [B, K]
    offsets = torch.arange(k, device=draft_ids.device)
    u = uniform_noise(seeds.repeat_interleave(k), (positions[:, None] + offsets).flatten(), ACCEPT, 1).view(batch, k)
    accepted = (u < acceptance_probability(p_draft, q_draft)) & (offsets[None, :] < num_draft[:, None])
    num_accepted = accepted.long().cumprod(-1).sum(-1)                                      # length of the accepted prefix
    # 2. One more token at index n = num_accepted: recovered after a rejection, bonus otherwise.
    take = lambda x: x.gather(1, num_accepted.clamp(max=x.shape[1] - 1)[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    p_next, q_next = take(p), take(q) if k > 0 else torch.zeros_like(p[:, 0])
    weights = next_token_weights(p_next, q_next, rejected=num_accepted < num_draft)
    next_token = race(weights, uniform_noise(seeds, positions + num_accepted, EMIT, vocab))
    tokens = torch.cat([draft_ids, draft_ids[:, :1]], dim=1) if k > 0 else next_token[:, None].clone()
    tokens = tokens.scatter(1, num_accepted[:, None], next_token[:, None])
    return tokens, num_accepted


def verify_greedy(target_ids: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor):
    """rejection_sample for a batch where every request is greedy, given the target's argmax at each
    position, target_ids [B, K+1] (no softmax, nothing over the vocabulary here): accept while the
    draft equals the argmax; the outputs are the argmaxes."""
    k = draft_ids.shape[1]
    offsets = torch.arange(k, device=draft_ids.device)
    match = (draft_ids == target_ids[:, :k]) & (offsets[None, :] < num_draft[:, None])
    return target_ids, match.long().cumprod(-1).sum(-1)


class Sampler:
    """`rejection_sample` (which, with K = 0, is plain sampling), torch.compile'd where that pays
    (CUDA by default), eager otherwise."""

    def __init__(self, compile: bool):
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)
        self.rejection_sample = wrap(rejection_sample)
        self.verify_greedy = wrap(verify_greedy)
