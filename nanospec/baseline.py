"""transformers, the baseline the benchmark compares with: the same checkpoint (a folder, a .gguf, or
a random model holding our own weights) and its generate() over the same groups of prompts."""
from __future__ import annotations

import torch

from nanospec import checkpoint
from nanospec.measure import timed


def transformers_model(path: str, dtype: torch.dtype, device: torch.device, ours=None):
    """The same checkpoint in transformers (a folder, or a .gguf through transformers' own GGUF
    reader); for random:NAME, a transformers model of its config holding `ours`'s random weights."""
    import transformers
    if path.startswith("random:"):
        return random_transformers_model(path, ours, dtype, device)
    if not path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = load_gguf_checkpoint(path)["config"]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    weights = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def random_transformers_model(path: str, ours, dtype: torch.dtype, device: torch.device):
    """transformers' model of random:NAME's config, with our model's weights (so both compute the
    same function: the same greedy tokens, the same drafts accepted)."""
    import transformers
    from nanospec.checkpoint import unpack_weights
    config = dict(checkpoint.RANDOM_MODELS[path.removeprefix("random:")])
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[config["architectures"][0]]
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    weights = unpack_weights({k: v for k, v in ours.state_dict().items() if "rotary" not in k}, ours.config)
    model.load_state_dict(weights, strict=False, assign=True)   # our tensors themselves: no second copy
    model.tie_weights()
    with torch.device(device):   # the rotary tables, buffers made at init, made for real
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"not loaded: {left[:3]}"
    return model.eval()


def resolve(target: str) -> str:
    """A local path for a checkpoint; random:NAME as it is."""
    return target if target.startswith("random:") else checkpoint.resolve(target)


def groups(prompt_ids: list[list[int]], batch_size: int, continuous: bool = False) -> list[list[list[int]]]:
    """How the bench runs the prompts: batch_size at a time, or all at once (continuous)."""
    size = len(prompt_ids) if continuous else batch_size
    return [prompt_ids[first:first + size] for first in range(0, len(prompt_ids), size)]


def time_transformers(model, prompt_ids: list[list[int]], batch_size: int, max_new_tokens: int, pad_id: int,
                      **speculative) -> float:
    """transformers' generate() over the same groups; `speculative`: prompt_lookup_num_tokens=K or
    assistant_model=... (transformers supports those at batch size 1 only)."""
    elapsed, tokens = 0.0, 0
    for group in groups(prompt_ids, batch_size):
        longest = max(len(ids) for ids in group)   # left padding, as batched generate() needs
        ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group], device=model.device)
        out, seconds = timed(model.device, lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id, **speculative))
        elapsed += seconds
        assert out.shape[1] == longest + max_new_tokens
        tokens += len(group) * max_new_tokens
    return tokens / elapsed
