"""Requests, the continuous-batching scheduler and the step loop.

A step is: schedule (prefill chunks, or one decode token per running request), run the model,
sample, commit. Invariants of a running request:
- every token but the last is in the KV cache once its prefill is done (num_cached == len(tokens) - 1);
- a preempted request loses its cache (num_cached = 0) and is recomputed from its tokens, so it
  is never lost; counter-based sampling (sampler.py) makes its output independent of preemption.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from nanospec.errors import NanospecError
from nanospec.kv_cache import BlockAllocator, KVCache, build_metadata
from nanospec.sampler import Sampler


@dataclass
class SamplingParams:
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0           # nucleus sampling; 1 = off
    top_k: int = 0               # 0 = off
    max_tokens: int = 64
    seed: int | None = None      # None: a random seed per request
    stop: list[str] = field(default_factory=list)   # stop strings, cut from the returned text
    ignore_eos: bool = False

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise NanospecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise NanospecError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise NanospecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise NanospecError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise NanospecError(f"seed must be an integer, got {self.seed!r}")


@dataclass(slots=True)
class Request:
    index: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int                  # prompt + max_tokens, capped at the model's context
    tokens: list[int] = field(default_factory=list)    # prompt + output
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    text: str = ""

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


@dataclass
class Batch:
    requests: list[Request]
    query_lens: list[int]         # new tokens per request in this forward pass
    is_prefill: bool


class Scheduler:
    """Continuous batching: admit waiting requests while blocks allow, prefill in chunks under a
    token budget, and when decode runs out of blocks preempt the newest request (free, recompute)."""

    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        while True:
            batch = self._schedule_prefill() or self._schedule_decode()
            if batch:
                return batch
            self.preempt(self.running[-1])   # every running request is stuck in prefill: make room

    def _schedule_prefill(self) -> Batch | None:
        budget, chosen, lens = self.max_num_batched_tokens, [], []
        candidates = [r for r in self.running if r.in_prefill] + list(self.waiting)
        for req in candidates:
            if budget == 0:
                break
            is_waiting = req not in self.running
            if is_waiting and len(self.running) >= self.max_num_seqs:
                break
            chunk = min(len(req.tokens) - req.num_cached, budget)
            if not self.allocator.can_grow(req.block_table, req.num_cached + chunk):
                break
            self.allocator.grow(req.block_table, req.num_cached + chunk)
            if is_waiting:
                self.waiting.popleft()
                self.running.append(req)
            chosen.append(req)
            lens.append(chunk)
            budget -= chunk
        return Batch(chosen, lens, is_prefill=True) if chosen else None

    def _schedule_decode(self, num_new: int = 1) -> Batch | None:
        chosen = []
        for req in list(self.running):
            if req not in self.running or req.in_prefill:
                continue
            while not self.allocator.can_grow(req.block_table, req.num_cached + num_new):
                self.preempt(self.running[-1])
                if req not in self.running:
                    break
            else:
                self.allocator.grow(req.block_table, req.num_cached + num_new)
                chosen.append(req)
        return Batch(chosen, [num_new] * len(chosen), is_prefill=False) if chosen else None

    def preempt(self, req: Request) -> None:
        self.allocator.release(req.block_table)
        req.num_cached = 0
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        self.allocator.release(req.block_table)
        self.running.remove(req)


@dataclass
class Stats:
    generated_tokens: int = 0
    steps: int = 0                # decode (and, later, verify) steps
    request_steps: int = 0        # sum over decode steps of the requests in the step
    decode_tokens: int = 0        # tokens those request-steps emitted (prefill's first token excluded)
    prefill_steps: int = 0
    preemptions: int = 0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict:
        tps = self.generated_tokens / self.elapsed_s if self.elapsed_s else 0.0
        return {"generated_tokens": self.generated_tokens, "steps": self.steps,
                "prefill_steps": self.prefill_steps, "preemptions": self.preemptions,
                # tokens a request gains per step: 1 for plain decoding, up to K + 1 with speculation
                "mean_acceptance_length": round(self.decode_tokens / self.request_steps, 4) if self.request_steps else 0.0,
                "acceptance_rate_per_position": [], "elapsed_s": round(self.elapsed_s, 4),
                "tokens_per_second": round(tps, 2)}


class Engine:
    """Owns the model, its KV cache, the scheduler and the sampler; `step` advances every request."""

    def __init__(self, model, tokenizer, device: torch.device, max_model_len: int, num_kv_blocks: int,
                 block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 compile_sampler: bool | None = None):
        cfg = model.config
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_model_len = max_model_len
        self.kv_cache = KVCache(cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                next(model.parameters()).dtype, device)
        self.scheduler = Scheduler(self.kv_cache.allocator, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler(compile=device.type == "cuda" if compile_sampler is None else compile_sampler)
        self.eos_ids = set(cfg.eos_token_ids) | set(tokenizer.eos_ids)
        self.stats = Stats()

    def new_request(self, index: int, prompt: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A validated request; `scheduler.waiting.extend(...)` queues it."""
        params.validate()
        if not prompt_ids:
            raise NanospecError(f"prompt {index} is empty; give at least one token of text")
        if len(prompt_ids) >= self.max_model_len:
            raise NanospecError(f"prompt {index} has {len(prompt_ids)} tokens but the context holds "
                                f"{self.max_model_len}; shorten the prompt or raise max_model_len")
        max_len = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        allocator = self.kv_cache.allocator
        if allocator.blocks_for(max_len) > allocator.num_blocks:
            raise NanospecError(f"request {index} needs up to {max_len} tokens of KV cache but the pool holds "
                                f"{allocator.num_blocks * allocator.block_size}; raise the KV cache size "
                                "or lower max_tokens")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Request(index, prompt, list(prompt_ids), params, seed, max_len, tokens=list(prompt_ids))

    def step(self) -> list[Request]:
        """One forward pass over the scheduled batch; returns the requests that got new tokens."""
        batch = self.scheduler.schedule()
        new_tokens = self.run_batch(batch)   # [(request, token)], one host sync inside
        for req, token in new_tokens:
            self.commit(req, token)
        return [req for req, _ in new_tokens]

    @torch.inference_mode()
    def run_batch(self, batch: Batch) -> list[tuple[Request, int]]:
        reqs, lens = batch.requests, batch.query_lens
        input_ids, positions = [], []
        for req, n in zip(reqs, lens):
            input_ids += req.tokens[req.num_cached:req.num_cached + n]
            positions += range(req.num_cached, req.num_cached + n)
        meta = build_metadata([r.block_table for r in reqs], [r.num_cached for r in reqs], lens,
                              self.kv_cache.block_size, self.device)
        to_device = lambda xs, dtype=torch.int64: torch.tensor(xs, dtype=dtype, device=self.device)
        hidden, _ = self.model(to_device(input_ids), to_device(positions), self.kv_cache, meta)
        for req, n in zip(reqs, lens):
            req.num_cached += n
        # Sample for requests whose every token is now cached (decode, or the last prefill chunk).
        done = [i for i, r in enumerate(reqs) if r.num_cached == len(r.tokens)]
        if batch.is_prefill:
            self.stats.prefill_steps += 1
        else:
            self.stats.steps += 1
            self.stats.request_steps += len(reqs)
            self.stats.decode_tokens += len(done)
        if not done:
            return []
        last_rows = meta.query_start[1:][done] - 1
        logits = self.model.logits(hidden[last_rows])
        sampled = [reqs[i] for i in done]
        p = [r.params for r in sampled]
        if all(x.temperature == 0 for x in p):   # greedy: the race over one-hot rows is the argmax
            return list(zip(sampled, logits.argmax(-1).tolist()))
        tokens = self.sampler.sample(
            logits, to_device([x.temperature for x in p], torch.float32), to_device([x.top_k for x in p]),
            to_device([x.top_p for x in p], torch.float32), to_device([r.seed for r in sampled]),
            to_device([len(r.tokens) for r in sampled]), truncate=any(x.top_k or x.top_p < 1 for x in p))
        return list(zip(sampled, tokens.tolist()))   # the step's one device-to-host copy

    def commit(self, req: Request, token: int) -> None:
        """Append a sampled token and finish the request on EOS, a stop string or its length limit."""
        req.tokens.append(token)
        self.stats.generated_tokens += 1
        if token in self.eos_ids and not req.params.ignore_eos:
            return self.finish(req, "stop", drop_last=True)
        if req.params.stop and self.hit_stop_string(req):
            return self.finish(req, "stop")
        if len(req.tokens) >= req.max_len:
            return self.finish(req, "length")

    def hit_stop_string(self, req: Request) -> bool:
        longest = max(len(s.encode()) for s in req.params.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):])   # a stop string spans at most this
        if not any(s in tail for s in req.params.stop):
            return False
        text = self.tokenizer.decode(req.output_ids)
        req.text = text[:min(text.find(s) for s in req.params.stop if s in text)]
        return True

    def finish(self, req: Request, reason: str, drop_last: bool = False) -> None:
        req.finish_reason = reason
        if not req.text:
            ids = req.output_ids[:-1] if drop_last else req.output_ids
            req.text = self.tokenizer.decode(ids)
        self.scheduler.finish(req)

    def run_to_completion(self, on_step=None) -> None:
        start = time.perf_counter()
        preempted_before = self.scheduler.num_preemptions
        while self.scheduler.has_work():
            updated = self.step()
            if on_step:
                on_step(updated)
        self.stats.elapsed_s += time.perf_counter() - start
        self.stats.preemptions += self.scheduler.num_preemptions - preempted_before
