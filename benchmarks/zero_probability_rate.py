"""Measure how often the sampler emits a token of probability zero, at a real vocabulary size.

Every row is a distribution over V tokens of which only the top_k = 4 are possible (the rest are
cut by top-k: probability exactly 0); each draw uses its own (seed, position). Prints the number of
draws that landed outside the support. Usage: python -m benchmarks.zero_probability_rate [V] [DRAWS]
"""
import sys
import time

import torch

from nanospec.sampler import sample


def main(vocab: int = 151_936, draws: int = 4096, chunk: int = 256) -> None:
    g = torch.Generator().manual_seed(0)
    bad, start = 0, time.perf_counter()
    for first in range(0, draws, chunk):
        n = min(chunk, draws - first)
        logits = torch.randn(n, vocab, generator=g) * 3
        top_k = torch.full((n,), 4)
        tokens = sample(logits, torch.ones(n), top_k, torch.ones(n),
                        torch.arange(first, first + n) * 7919 + 1, torch.arange(n) % 97 + 5)
        support = logits.topk(4, dim=-1).indices
        bad += int((support != tokens[:, None]).all(-1).sum())
    print(f"V={vocab} draws={draws}: {bad} outside the top-4 support ({bad / draws:.3%}), "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
