"""EAGLE draft heads: one decoder layer that predicts the target's next feature from its current one.

EAGLE (Li et al. 2024) drafts at the feature level. Element i of the head's sequence is the pair
(feature f_i of the target at position i, embedding of token t_{i+1}); the head's output for it is
a guess of f_{i+1}, from which a token t_{i+2} is read. The head keeps its own one-layer paged KV
cache over these elements (element i at position i), and feeds its own output back as the next
feature to draft further. Both public checkpoint layouts load here:

EAGLE-1: the feature is the target's last hidden state (after the final norm: what the LM head
  reads). `fc` maps [embedding, feature] (2H) to H; `layers.0` is a decoder layer without an input
  norm; the output goes straight through the target's own LM head.
EAGLE-3: the feature is the concatenation of the hidden states entering three target layers (by
  default 2, L/2 and L-3), mapped by `fc` (3H -> H) on the first step only; `midlayer` normalizes
  embedding and feature separately (`input_layernorm`, `hidden_norm`) and attends over both
  concatenated (2H); `norm` and `lm_head` give logits over a reduced draft vocabulary, whose id d is
  the target's id d + d2t[d].
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from nanospec.checkpoint import check_loadable, check_weights, load_safetensors, read_json
from nanospec.errors import NanospecError
from nanospec.model import (MLP, Attention, Linear, ModelConfig, RMSNorm, RotaryEmbedding, for_inference, pack_weights,
                            unpack_weights)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class Eagle1Layer(nn.Module):
    """A Llama decoder layer whose input norm is dropped (the fc output is its input)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = Attention(config, layer_index=0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle1Head(nn.Module):
    version = 1

    def __init__(self, config: ModelConfig, fc_bias: bool):
        super().__init__()
        self.config = config
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([Eagle1Layer(config)])
        self.rotary = RotaryEmbedding(config)

    def forward(self, embeds, features, positions, kv_cache, meta):
        """embeds, features: [T, H] -> the predicted next features [T, H]."""
        layer = self.layers[0]
        x = self.fc(torch.cat([embeds, features], dim=-1))
        x = x + layer.self_attn(x, positions, self.rotary, kv_cache, meta)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, hidden, target) -> torch.Tensor:
        return target.logits(hidden)   # the target's LM head, on the un-normed prediction as in EAGLE-1


class Eagle3MidLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h = config.hidden_size
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index=0, input_size=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)


class Eagle3Head(nn.Module):
    version = 3

    def __init__(self, config: ModelConfig, target_hidden: int, draft_vocab: int, target_vocab: int):
        super().__init__()
        self.config = config
        self.fc = Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))
        self.rotary = RotaryEmbedding(config)

    def forward(self, embeds, features, positions, kv_cache, meta):
        """embeds [T, H]; features [T, 3H] from the target (first step) or [T, H] from the head."""
        if features.shape[-1] != self.config.hidden_size:
            features = self.fc(features)
        m = self.midlayer
        both = torch.cat([m.input_layernorm(embeds), m.hidden_norm(features)], dim=-1)
        x = features + m.self_attn(both, positions, self.rotary, kv_cache, meta)
        return x + m.mlp(m.post_attention_layernorm(x))

    def logits(self, hidden, target) -> torch.Tensor:
        """Logits over the target's vocabulary: -inf outside the draft vocabulary."""
        draft_logits = self.lm_head(self.norm(hidden)).float()
        target_ids = torch.arange(draft_logits.shape[-1], device=hidden.device) + self.d2t
        full = draft_logits.new_full((hidden.shape[0], target.config.vocab_size), float("-inf"))
        return full.index_copy(1, target_ids, draft_logits)


def read_eagle_weights(folder: str) -> dict[str, torch.Tensor]:
    if not os.path.isdir(folder):
        raise NanospecError(f"EAGLE head {folder!r} not found: give a folder with config.json and "
                            "model.safetensors (or pytorch_model.bin)")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        return load_safetensors([os.path.join(folder, f) for f in files])
    path = os.path.join(folder, "pytorch_model.bin")
    if os.path.exists(path):   # the original EAGLE-1 releases; tensors only, never pickled code
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise NanospecError(f"{path} is not a plain file of tensors ({type(e).__name__}: {str(e).splitlines()[0]}); "
                                "nanospec never runs pickled code: use a safetensors head") from e
        if not (isinstance(weights, dict) and all(isinstance(v, torch.Tensor) for v in weights.values())):
            raise NanospecError(f"{path} does not hold a dict of tensors; use a safetensors head")
        return weights
    raise NanospecError(f"no model.safetensors or pytorch_model.bin in EAGLE head folder {folder}")


def load_eagle_head(folder: str, target, device: torch.device, dtype: torch.dtype):
    """Read an EAGLE-1 or EAGLE-3 head, check it fits `target`, return (head, aux_layers or None)."""
    weights = {k.removeprefix("model."): v for k, v in read_eagle_weights(folder).items()}
    config_path = os.path.join(folder, "config.json")
    cfg = read_json(config_path, what="an EAGLE head folder needs config.json and model.safetensors")
    if any(k.startswith("midlayer.") for k in weights):
        version, needed = 3, ("fc.weight", "lm_head.weight")
    elif "fc.weight" in weights and any(k.startswith("layers.0.") for k in weights):
        version, needed = 1, ("fc.weight",)
    else:
        raise NanospecError(f"{folder} is not an EAGLE head: expected `fc` with `layers.0.*` (EAGLE-1) "
                            "or `midlayer.*` (EAGLE-3) tensors")
    for name in needed:
        if name not in weights or weights[name].dim() != 2:
            raise NanospecError(f"EAGLE-{version} head in {folder} lacks the matrix {name}; it is incomplete")
    has_bias = any(k.endswith("q_proj.bias") for k in weights)
    config = ModelConfig.from_hf({**cfg, "architectures": ["Qwen2ForCausalLM" if has_bias else "LlamaForCausalLM"],
                                  "num_hidden_layers": 1, "quantization_config": None,
                                  "max_position_embeddings": target.config.max_position_embeddings},
                                 source=config_path)
    check_fits(config, cfg, weights, version, target.config)
    if version == 1:
        head = Eagle1Head(config, fc_bias="fc.bias" in weights)
        aux = None
    else:
        aux = aux_layers(cfg, target.config.num_layers, config_path)
        head = Eagle3Head(config, target.config.hidden_size, weights["lm_head.weight"].shape[0],
                          target.config.vocab_size)
    load_into(head, weights, folder)
    check_trained_dtype(cfg, folder, dtype)
    return for_inference(head.to(device=device, dtype=dtype)), aux


def aux_layers(cfg: dict, num_layers: int, source: str) -> tuple[int, int, int]:
    """The three target layers whose inputs an EAGLE-3 head reads (its config, or the default)."""
    eagle_config = cfg.get("eagle_config") or {}
    aux = (eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None) \
        or default_aux_layers(num_layers)
    if not (isinstance(aux, (list, tuple)) and len(aux) == 3
            and all(isinstance(i, int) and 0 <= i <= num_layers for i in aux)):
        raise NanospecError(f"{source}: EAGLE-3 auxiliary layers {aux!r} are not three layers of the "
                            f"{num_layers}-layer target; the head was trained for a different model")
    return tuple(aux)


def check_trained_dtype(cfg: dict, folder: str, dtype: torch.dtype) -> None:
    """A head learns the features of the target in the dtype it was trained with (train_eagle.py
    records it); served beside the target in another dtype it drafts worse (never wrongly)."""
    trained, serving = cfg.get("trained_target_dtype"), str(dtype).removeprefix("torch.")
    if trained and trained != serving:
        warnings.warn(f"EAGLE head {folder} was trained on the target's {trained} features but the target runs in "
                      f"{serving} here: expect fewer accepted drafts; run with --dtype {trained} (dtype={trained!r})",
                      stacklevel=3)


def check_fits(config: ModelConfig, cfg: dict, weights: dict, version: int, target: ModelConfig) -> None:
    """A head trained for another model fails here, with the reason, instead of deep inside a matmul."""
    fc_in = weights["fc.weight"].shape[1]
    expected_in = 2 * target.hidden_size if version == 1 else 3 * target.hidden_size
    if config.hidden_size != target.hidden_size or fc_in != expected_in:
        raise NanospecError(f"EAGLE-{version} head has hidden size {config.hidden_size} (fc input {fc_in}) but the "
                            f"target's hidden size is {target.hidden_size} (needs fc input {expected_in}); "
                            "use a head trained for this target")
    vocab = weights["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in weights else cfg.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise NanospecError(f"EAGLE-{version} head's vocabulary has {vocab} tokens but the target's has "
                            f"{target.vocab_size}; use a head trained for this target")


def load_into(head: nn.Module, weights: dict[str, torch.Tensor], folder: str) -> None:
    """Check the tensors against the head's own (t2d is optional: unused here; an EAGLE-1 head may
    ship the target's embedding) and load them."""
    expected = unpack_weights(dict(head.state_dict()), head.config)   # under the checkpoint's own names
    if "t2d" not in weights:
        expected.pop("t2d", None)
    source = f"EAGLE head in {folder}"
    check_loadable(weights, source, integer_names=("d2t", "t2d"))
    check_weights(expected, weights, source, "it is incomplete", ignored=("embed_tokens.weight",))
    if "d2t" in weights:
        target_ids = torch.arange(len(weights["d2t"])) + weights["d2t"]
        if int(target_ids.max()) >= head.t2d.shape[0] or int(target_ids.min()) < 0:
            raise NanospecError("EAGLE-3 head's d2t maps draft tokens outside the target's vocabulary; "
                                "use a head trained for this target")
    head.load_state_dict(pack_weights({k: v for k, v in weights.items() if k != "embed_tokens.weight"}), strict=False)
