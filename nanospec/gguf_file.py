"""Read a llama.cpp GGUF file: the model config, the dequantized weights under Hugging Face names,
and the tokenizer metadata. The `gguf` package (llama.cpp's own reader) parses and dequantizes.

Two traps. Llama 3.1 / 3.2's long-context RoPE scaling ("llama3" in config.json) is not in the
metadata: the converter writes it as a tensor, rope_freqs, one divisor per rotary frequency, and
`llama3_scaling` recovers the config's parameters from it. And the converter permutes the rows of
q_proj and k_proj of Llama models so that llama.cpp's RoPE kernel can rotate adjacent pairs (0, 1),
(2, 3), ... ; our RoPE (like Hugging Face's) rotates the halves (i, i + d/2). `unpermute_rotary`
undoes the converter's permutation.
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


def hf_config(meta: dict, path: str = "the GGUF file", rope_freqs: np.ndarray | None = None) -> dict:
    """The Hugging Face config.json equivalent of the GGUF metadata (checkpoint.read_config checks its
    values); rope_freqs: the file's rope_freqs tensor (rope_freqs(reader)), if any."""
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
    if key("rope.scaling.type", "none") != "none":   # linear, yarn: no family nanospec runs has them
        raise NanospecError(f"{path} scales RoPE by {key('rope.scaling.type')!r}, which nanospec does not "
                            "support (only Llama 3's scaling, as llama.cpp writes it: a rope_freqs tensor)")
    theta = key("rope.freq_base", 10000.0)
    head_dim = key("attention.key_length") or (hidden // heads if isinstance(hidden, int) and heads else None)
    scaling = None if rope_freqs is None else llama3_scaling(rope_freqs, theta, head_dim, path)
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
        "rope_theta": theta, **({"rope_scaling": scaling} if scaling else {}),
        "max_position_embeddings": key("context_length", 4096),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [t for t in (meta.get("tokenizer.ggml.eos_token_id"),
                                     meta.get("tokenizer.ggml.eot_token_id")) if t is not None],
    }


def rope_freqs(reader) -> np.ndarray | None:
    """The rope_freqs tensor (float64), or None: llama.cpp's converter writes it for Llama 3.1 / 3.2."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if tensor is None else np.asarray(tensor.data, dtype=np.float64).reshape(-1)


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, path: str) -> dict | None:
    """config.json's "llama3" rope_scaling that divides each rotary frequency theta^(-2i/d) by what
    rope_freqs holds (None where it divides none). The converter computes the divisors from the
    config: 1 for short wavelengths, `factor` for long ones, and between them 1 / ((1 - s) / factor
    + s), s = (old_len / wavelength - low) / (high - low). They depend on old_len / low and high /
    low only, so low = 1 and, from the band between, s is a line in 1 / wavelength whose slope and
    intercept give old_len and high. The parameters found are checked to give the divisors back."""
    if not (isinstance(head_dim, int) and head_dim > 0 and isinstance(theta, (int, float)) and theta > 1):
        raise NanospecError(f"{path}: its rope_freqs tensor needs a head size and a RoPE base to read, and "
                            f"its metadata gives {head_dim!r} and {theta!r}; re-convert the model")
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    refuse = NanospecError(f"{path}: its rope_freqs tensor ({divisors.size} values) is not Llama 3's RoPE "
                           f"scaling for a head of {head_dim}, which is all nanospec reads it as; re-convert "
                           "the model with llama.cpp's convert_hf_to_gguf.py, or load its Hugging Face "
                           "folder")
    if divisors.shape != inv_freq.shape or not np.isfinite(divisors).all() or (divisors < 1 - 1e-6).any():
        raise refuse
    factor = float(divisors.max())
    if factor < 1 + 1e-6:
        return None
    band = (divisors > 1 + 1e-4) & (divisors < factor * (1 - 1e-4))
    if band.sum() < 2:
        raise refuse
    s = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    # s = (old_len / wavelength - 1) / (high - 1): a line in 1 / wavelength
    slope, intercept = np.polyfit(inv_freq[band] / (2 * np.pi), s, 1)
    if intercept >= 0:
        raise refuse
    # the parameters, as config.json writes them, then the divisors they give
    factor, high = round(factor, 4), round(float(1 - 1 / intercept), 4)
    old_len = int(round(-slope / intercept))
    wavelength = 2 * np.pi / inv_freq
    smooth = (old_len / wavelength - 1) / (high - 1)
    band = 1 / ((1 - smooth) / factor + smooth)
    expected = np.where(wavelength > old_len, factor, np.where(wavelength < old_len / high, 1.0, band))
    if not np.allclose(expected, divisors, rtol=1e-4, atol=0):
        raise refuse
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": old_len}


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
            continue   # rope_freqs: read into the config (llama3_scaling)
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
            w = torch.from_numpy(np.ascontiguousarray(values).astype(np.float32))
        except Exception as e:   # a quantization type this gguf cannot dequantize, or a damaged tensor
            raise NanospecError(f"cannot read tensor {tensor.name} ({tensor.tensor_type.name}) of the GGUF "
                                f"file ({e}); upgrade the gguf package (pip install -U gguf) or re-convert "
                                "the model") from e
        heads = config.num_heads if parts[-1] == "attn_q" else config.num_kv_heads
        if config.family == "llama" and parts[-1] in ("attn_q", "attn_k") and w.shape[0] % (2 * heads) == 0:
            w = unpermute_rotary(w, heads)   # (a tensor of the wrong size is left to the shape check)
        weights[name] = w
    return weights
