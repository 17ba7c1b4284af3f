"""A request as the engine holds it (its tokens, block table, speculation counts) and what a caller
gets back when it finishes."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from nanospec.errors import NanospecError, param, shown
from nanospec.kv_cache import BlockTable
from nanospec.sampling_params import SamplingParams


@dataclass(slots=True)
class Request:
    index: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int                  # prompt + max_tokens, capped at the model's context
    tokens: list[int] = field(default_factory=list)    # prompt + output
    block_table: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0
    finish_reason: str | None = None
    # set when it finishes: the output before any stop (through it: include_stop_str_in_output)
    text: str | None = None
    error: str | None = None      # why it failed (finish_reason "error"): its own logits were not finite
    proposer_state: object = None  # the proposer's per-request state (its cache, n-gram index)
    suffix_stream: object = None   # suffix decoding's index of its tokens (beside a hybrid's model state)
    # Its own speculation: decode steps with drafts, drafts found and accepted (in all, per draft position).
    # decode steps it took part in (its acceptance length: output tokens / these)
    decode_steps: int = 0
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None   # per output token, when asked: its own and the top N's
    # with penalties: its prompt's tokens on the device [V] (logits_processors.prompt_mask)
    prompt_mask: object = None
    step_logprobs: list[dict[int, float]] | None = None   # those of the last step's tokens, until committed

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.tokens) - 1


def own_cap(req: Request, k: int) -> int:
    """k, at most the request's own num_speculative_tokens (0: no speculation for it)."""
    cap = req.params.num_speculative_tokens
    return k if cap is None else min(k, cap)


def emittable_vocab(config, tokenizer) -> int:
    """How many ids (0 .. n - 1) a request may hold: those the model has an embedding and logits for
    and the tokenizer decodes."""
    return min(config.vocab_size, tokenizer.vocab_size)


def new_request(index: int, prompt: str, prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                max_model_len: int, pool_tokens: int, max_k: int, drafts: bool) -> Request:
    """A request checked against what its engine holds: ids 0 .. vocab_size - 1, a context of
    max_model_len, a KV pool of pool_tokens, at most max_k drafts a step (drafts: it has a proposer)."""
    params.validate()
    if not prompt_ids:
        raise NanospecError(f"prompt {index} is empty; give at least one token of text")
    if bad := [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]:
        raise NanospecError(f"prompt {index} holds token id {shown(bad[0])}, outside this model and "
                            f"tokenizer's ids 0..{vocab_size - 1}; give ids the tokenizer produces")
    if outside := [t for t in params.stop_token_ids if t >= vocab_size]:
        raise NanospecError(f"{param('stop_token_ids')} holds {shown(outside[0])}, outside this "
                            f"model and tokenizer's ids 0..{vocab_size - 1}")
    if len(prompt_ids) >= max_model_len:
        raise NanospecError(f"prompt {index} has {len(prompt_ids)} tokens but the context holds "
                            f"{max_model_len}; shorten the prompt or raise {param('max_model_len')}")
    max_len = min(len(prompt_ids) + params.max_tokens, max_model_len)
    if max_len > pool_tokens:
        raise NanospecError(f"request {index} needs up to {max_len} tokens of KV cache but the pool "
                            f"holds {pool_tokens}; raise the KV cache size or lower max_tokens")
    asked = params.num_speculative_tokens
    if asked is not None and asked > max_k:
        raise NanospecError(f"request {index} asks for {param('num_speculative_tokens')} {asked} but "
                            "this engine " + (f"drafts at most {max_k}; ask for 0..{max_k}" if drafts
                                              else "has no proposer; ask for 0 or leave it unset"))
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return Request(index, prompt, list(prompt_ids), params, seed, max_len, tokens=list(prompt_ids),
                   logprobs=None if params.logprobs is None else [])


def end_of(req: Request, token: int, eos_ids: set[int], tokenizer) -> tuple[str, bool] | None:
    """Whether the newest token, just appended, ends the request, and how: (finish reason, whether its
    text drops that token); None: it goes on. An EOS (unless ignore_eos) or a stop token ends it
    first, then a stop string (req.text is then the output cut there), then its length."""
    p = req.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return "stop", not p.include_stop_str_in_output
    if p.stop and hit_stop_string(req, tokenizer):
        return "stop", False
    return ("length", False) if len(req.tokens) >= req.max_len else None


def hit_stop_string(req: Request, tokenizer) -> bool:
    """Whether the newest token completed a stop string; if so req.text is the output cut there."""
    p = req.params
    req.text = tokenizer.text_before_stop(req.output_ids, p.stop, p.skip_special_tokens,
                                          p.include_stop_str_in_output)
    return req.text is not None


def note_logprobs(reqs: list[Request], emitted: list[list[int]], logits: torch.Tensor) -> None:
    """For each request that asked, the logprobs of the tokens the step emitted for it and of the N
    most likely at each of their positions (req.step_logprobs, one {id: logprob} per token, its own
    first; commit keeps those of the tokens it keeps). Raw logprobs, vLLM's default: the log-softmax
    of the target's logits in float32, before temperature, top-k or top-p. logits: [bucket, K + 1,
    vocab], row b's queries in order; in one copy back."""
    rows = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
    # (a toy vocabulary may hold fewer)
    n = min(max(reqs[b].params.logprobs for b in rows), logits.shape[-1])
    q = max(len(emitted[b]) for b in rows)
    logprobs = torch.log_softmax(logits[rows, :q].float(), dim=-1)   # [R, q, vocab]
    ids = torch.tensor([emitted[b] + [0] * (q - len(emitted[b])) for b in rows], device=logits.device)
    own = logprobs.gather(-1, ids[..., None])
    top = logprobs.topk(n, dim=-1)
    # ids exact in float64
    host = torch.cat([own.double(), top.values.double(), top.indices.double()], dim=-1).tolist()
    for i, b in enumerate(rows):
        keep = reqs[b].params.logprobs
        top_n = lambda row: zip(row[1 + n:1 + n + keep], row[1:1 + keep])   # (id, logprob) pairs
        reqs[b].step_logprobs = [{token: row[0], **{int(t): v for t, v in top_n(row) if int(t) != token}}
                                 for token, row in zip(emitted[b], host[i])]


@dataclass
class RequestOutput:
    index: int
    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop" (EOS or a stop string) or "length"
    prompt_token_ids: list[int]
    # per token of token_ids, when asked: {id: logprob}, its own first
    logprobs: list[dict[int, float]] | None = None
