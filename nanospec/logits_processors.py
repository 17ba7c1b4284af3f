"""The logits processors a request may ask for beyond temperature / top-k / top-p: vLLM's
repetition, frequency and presence penalties and min_p, applied to a verify step's logits at every
position (each position counts the drafts before it as output), in vLLM's order (penalties, then
min_p; the sampler's temperature, top-k and top-p come after)."""
from __future__ import annotations

import numpy as np
import torch

from nanospec.kv_cache import upload


def penalize(logits: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor, drafts: torch.Tensor,
             repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
             before: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM's penalties on R requests' logits [R, q, V] (float32) at their q verify positions:
    position j follows the request's output and its first j drafts (drafts [R, q - 1]; [R, 0]:
    every position as the first); in a draft tree, its node's path instead (before [R, q, q - 1]:
    True where draft i is on position j's path, tree.py's ancestor mask without the root).
    in_prompt [R, V]: the prompt's tokens (prompt_mask); counts [R, V]: each token's count in the
    output; the penalties [R]. Repetition divides a positive
    logit and multiplies a negative one of every token in the prompt or the output so far,
    frequency subtracts frequency x the token's count in it, presence subtracts presence from
    every token in it (OpenAI's presence_penalty and frequency_penalty)."""
    repetition, frequency, presence = (x[:, None, None] for x in (repetition, frequency, presence))

    def apply(x, count, prompt):   # x: logits of tokens seen `count` times so far, `prompt`: in the prompt
        seen = count > 0
        x = torch.where(seen | prompt, torch.where(x > 0, x / repetition, x * repetition), x)
        return x - frequency * count - presence * seen.float()
    out = apply(logits, counts[:, None, :], in_prompt[:, None, :])   # every position with the output's counts
    q, k = logits.shape[1], drafts.shape[1]
    if k:
        # Then the drafts' tokens again, with the drafts before each position counted: only they
        # differ between positions. Entry [r, j, i] is d_{i+1}'s logit at position j, where its count
        # adds how many of d_1 .. d_j are d_{i+1} (a token drafted twice is written twice, alike).
        same = (drafts[:, :, None] == drafts[:, None, :]).float()   # [R, i', i]: d_{i'+1} is d_{i+1}
        j, i = torch.arange(q, device=logits.device), torch.arange(k, device=logits.device)
        # [(R,) q, K]: d_{i+1} comes before position j
        before = (j[:, None] > i).float() if before is None else before.float()
        count = counts.gather(1, drafts)[:, None, :] + before @ same   # [R, q, K]
        ids = drafts[:, None, :].expand(-1, q, -1)
        out.scatter_(2, ids, apply(logits.gather(2, ids), count, in_prompt.gather(1, drafts)[:, None, :]))
    return out


def prompt_mask(prompt_ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[V] bool: the tokens of a prompt (made once per request: a prompt may be long)."""
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
    return mask


def min_p_mask(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p on R requests' logits [R, q, V]: -inf for a token whose probability at the
    request's temperature ([R]) is below min_p ([R]) x the most likely's; min_p 0 drops nothing (a
    greedy request keeps its argmax whatever min_p drops: it takes 0)."""
    temperature, min_p = temperature[:, None, None], min_p[:, None, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    return logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))


def process(logits: torch.Tensor, drafts: torch.Tensor, processed: list,
            no_prompt: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """The step's logits [bucket, K + 1, vocab] in float32, the processed rows' with their
    penalties and then their min_p, all rows in one batch; processed: the (row, request) pairs that
    ask for them, no_prompt: [vocab] False (a row without penalties), before: a tree step's paths
    (penalize). Eager only (cuda_graph.py's
    replay): it reads the requests' tokens on the host and sends them, with the rows and their
    parameters, in one copy."""
    logits = logits.float()
    vocab = logits.shape[-1]
    reqs = [r for _, r in processed]
    for req in reqs:
        if req.params.penalized and req.prompt_mask is None:   # once per request: a prompt may be long
            req.prompt_mask = prompt_mask(req.prompt_ids, vocab, logits.device)
    n = len(reqs)
    # a row without penalties takes neutral ones (an identity, bit for bit), a greedy row min_p 0 at T 1
    params = [r.params for r in reqs]
    values = np.array([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                        p.min_p if p.temperature > 0 else 0.0, p.temperature or 1.0] for p in params],
                      dtype=np.float64).T.copy().view(np.int64)   # [5, n], float64 bits
    outputs = [np.asarray(r.output_ids if r.params.penalized else (), dtype=np.int64) for r in reqs]
    flat = np.concatenate([i * vocab + ids for i, ids in enumerate(outputs)])  # row i, token j: i * V + j
    device = upload(np.concatenate([[b for b, _ in processed], values.ravel(), flat]), logits.device)
    rows = device[:n]
    repetition, frequency, presence, min_p, temperature = device[n:6 * n].view(5, n).view(
        torch.float64).float()
    counts = torch.zeros(n * vocab, device=logits.device).index_add_(
        0, device[6 * n:], torch.ones(len(flat), device=logits.device)).view(n, vocab)
    in_prompt = torch.stack([r.prompt_mask if r.params.penalized else no_prompt for r in reqs])
    out = penalize(logits[rows], in_prompt, counts, drafts[rows], repetition, frequency, presence,
                   None if before is None else before[rows])
    logits[rows] = min_p_mask(out, temperature, min_p)
    return logits
