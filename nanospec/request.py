"""A request as the engine holds it (its tokens, block table, speculation counts) and what a caller
gets back when it finishes."""
from __future__ import annotations

from dataclasses import dataclass, field

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
