"""Read a llama.cpp GGUF file: the model config, the dequantized weights under Hugging Face names,
and the tokenizer metadata. The `gguf` package (llama.cpp's own reader) parses and dequantizes.

One trap: llama.cpp's converter permutes the rows of q_proj and k_proj of Llama models so that its
RoPE kernel can rotate adjacent pairs (0, 1), (2, 3), ... ; our RoPE (like Hugging Face's) rotates
the halves (i, i + d/2). `unpermute_rotary` undoes the converter's permutation.
"""
from __future__ import annotations

import numpy as np
import torch

from nanospec.errors import NanospecError

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

TENSOR_NAMES = {  # GGUF name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_reader(path: str):
    try:
        import gguf
    except ImportError as e:
        raise NanospecError("reading .gguf files needs the gguf package: pip install gguf") from e
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise NanospecError(f"{path} is not a readable GGUF file ({e}); re-download or re-convert it") from e


def metadata(reader) -> dict:
    """All key/value fields as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: dict, path: str = "the GGUF file") -> dict:
    """The Hugging Face config.json equivalent of the GGUF metadata (ModelConfig.from_hf checks its values)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NanospecError(f"unsupported GGUF architecture {arch!r} in {path}; nanospec supports "
                            f"{', '.join(GGUF_ARCHITECTURES)}")

    def key(name, default=None, required=False):
        value = meta.get(f"{arch}.{name}", default)
        if value is None and required:
            raise NanospecError(f"{path} lacks the GGUF metadata key {arch}.{name}; re-convert the model "
                                "with llama.cpp's convert_hf_to_gguf.py")
        return value

    heads = key("attention.head_count", required=True)
    hidden = key("embedding_length", required=True)
    tokens = meta.get("tokenizer.ggml.tokens")
    if key("vocab_size") is None and not isinstance(tokens, list):
        raise NanospecError(f"{path} has neither {arch}.vocab_size nor a tokenizer.ggml.tokens vocabulary; "
                            "re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": key("vocab_size") or len(tokens),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [t for t in (meta.get("tokenizer.ggml.eos_token_id"),
                                     meta.get("tokenizer.ggml.eot_token_id")) if t is not None],
    }


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def state_dict(reader, config) -> dict[str, torch.Tensor]:
    """Dequantized weights under Hugging Face names (float32); config: the model's ModelConfig."""
    from gguf.quants import dequantize
    weights = {}
    for tensor in reader.tensors:
        base, _, suffix = tensor.name.rpartition(".")   # "blk.3.attn_q", "weight"
        parts = base.split(".")
        if parts[0] == "blk" and parts[2] in TENSOR_NAMES:
            name = f"model.layers.{parts[1]}.{TENSOR_NAMES[parts[2]]}.{suffix}"
        elif base in GLOBAL_NAMES:
            name = f"{GLOBAL_NAMES[base]}.{suffix}"
        else:
            continue   # e.g. rope_freqs: recomputed from the config
        try:
            w = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)).astype(np.float32))
        except Exception as e:   # a quantization type this gguf package cannot dequantize, or a damaged tensor
            raise NanospecError(f"cannot read tensor {tensor.name} ({tensor.tensor_type.name}) of the GGUF file ({e}); "
                                "upgrade the gguf package (pip install -U gguf) or re-convert the model") from e
        heads = config.num_heads if parts[-1] == "attn_q" else config.num_kv_heads
        if config.family == "llama" and parts[-1] in ("attn_q", "attn_k") and w.shape[0] % (2 * heads) == 0:
            w = unpermute_rotary(w, heads)   # (a tensor of the wrong size is left for the shape check to name)
        weights[name] = w
    return weights
