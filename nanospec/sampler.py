"""Sampling without host syncs: each row of a batch has its own temperature, top-k, top-p and seed.

Two ideas keep it batched, reproducible and sync-free:
- `target_probs` turns logits into the exact distribution a request samples from (temperature,
  then top-k, then top-p on what top-k kept, renormalized); greedy rows (T = 0) become one-hot on
  the argmax, so greedy and sampled rows share every later step.
- randomness is counter-based: the uniform noise for (seed, position, stream, vocab index) is a
  hash of those numbers, like Philox. A request's draws therefore do not depend on which other
  requests share its batch, or on preemption and recompute, and need no generator state.
A token is drawn by the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) independent,
which picks i with probability p_i / sum(p) (the "Gumbel-max" trick in another dress).
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


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
    return race(probs, uniform_noise(seeds, positions, stream=0, size=logits.shape[-1]))


class Sampler:
    """`sample`, torch.compile'd where that pays (CUDA by default), eager otherwise."""

    def __init__(self, compile: bool):
        self.sample = torch.compile(sample, dynamic=True) if compile else sample
