"""Pearson's chi-square goodness-of-fit test, for the tests that compare samples with exact probabilities."""
import torch


def chi_square_pvalue(counts, probs) -> float:
    """P-value of observing `counts` (one per outcome) if outcomes have probabilities `probs`.

    Outcomes expected fewer than 5 times are pooled into one cell (the usual validity rule); an
    outcome with probability 0 that occurs at all gives p-value 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    n = counts.sum()
    if (counts[probs <= 1e-12] > 0).any():
        return 0.0
    expected = n * probs
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    dof = len(expected) - 1
    if dof < 1:
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()
