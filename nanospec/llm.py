"""The front door: `LLM(target).generate(prompts, SamplingParams(...))`.

Loads the checkpoint and its tokenizer, picks device and dtype, sizes the paged KV cache and runs
the engine until every request is done.
"""
from __future__ import annotations

import torch

from nanospec import checkpoint
from nanospec.engine import Engine, RequestOutput, SamplingParams, Stats
from nanospec.errors import NanospecError
from nanospec.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NanospecError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu or auto")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise NanospecError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise NanospecError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def kv_blocks_for_memory(config, dtype: torch.dtype, block_size: int, memory_gb: float) -> int:
    bytes_per_block = 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize
    return max(1, int(memory_gb * 2**30 // bytes_per_block))


class LLM:
    def __init__(self, target: str | None = None, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, kv_cache_gb: float | None = None, block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, compile_sampler: bool | None = None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        ckpt = checkpoint.read_checkpoint(target)
        self.config = ckpt.config
        self.model = checkpoint.build_model(ckpt, self.device, self.dtype)
        self.tokenizer = load_tokenizer(ckpt.path, ckpt.gguf_metadata)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        if kv_cache_gb is None:
            kv_cache_gb = self.default_kv_cache_gb()
        num_blocks = kv_blocks_for_memory(self.config, self.dtype, block_size, kv_cache_gb)
        self.engine = Engine(self.model, self.tokenizer, self.device, self.max_model_len, num_blocks,
                             block_size, max_num_seqs, max_num_batched_tokens, compile_sampler)

    def default_kv_cache_gb(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return 0.8 * free / 2**30
        return 1.0

    @property
    def stats(self) -> dict:
        return self.engine.stats.as_dict()

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        return self.tokenizer.apply_chat_template(prompt) if chat else self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str] | str, params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, on_step=None) -> list[RequestOutput]:
        """Generate for every prompt (a list of params gives each its own). `on_step(requests)` is
        called after each step with the requests that got new tokens (for streaming)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise NanospecError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; give one, or one each")
        requests = [self.engine.new_request(i, p, self.encode_prompt(p, chat), sp)
                    for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
        self.engine.scheduler.waiting.extend(requests)   # only once every request is valid
        self.engine.stats = Stats()                      # llm.stats describes this call
        self.engine.run_to_completion(on_step)
        return [RequestOutput(r.index, r.prompt, r.text, r.output_ids, r.finish_reason, r.prompt_ids)
                for r in requests]
