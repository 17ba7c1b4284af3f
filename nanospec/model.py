"""The decoder of the Llama 3.x and Qwen 2 / 2.5 / 3 families, one class per box of the paper.

Differences between the families are flags on one config: Qwen2 adds a bias to q/k/v, Qwen3 an
RMSNorm on each head of q and k, Llama 3.x may scale RoPE ("llama3" rope_scaling), SmolLM2 and the
small Qwens tie the LM head to the embeddings. Parameter names follow the Hugging Face checkpoint
keys, except that q/k/v and gate/up are packed into one matrix each (`qkv_proj`, `gate_up_proj`;
checkpoint.pack_weights): one matmul instead of three or two, which is what a memory-bound decode
step wants. Each projection is a cpu_linear.Linear: an nn.Linear with a CPU fast path for the few
rows of a decode step.

The forward pass takes a flat batch of new tokens from many requests, each token with its own
position, and reads and writes K/V through the paged cache (kv_cache.py): a prefill chunk, a
one-token decode step and a K+1-token verify step are the same call.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from nanospec import triton_attention
from nanospec.cpu_linear import Linear
from nanospec.kv_cache import AttentionMetadata, KVCache
from nanospec.kv_mirror import paged_attention

# On CUDA the small elementwise pieces of a layer (an RMSNorm with the residual add before it, the
# rotation of q and k, SiLU-and-mul) each run as one kernel that torch.compile makes of the function,
# as nano-vllm compiles its small layers: in a captured graph that is one node where eager PyTorch
# launches 4-8. On a CPU the functions run eagerly: there a compiled function's call costs more
# than the few ops it would fuse (docs/performance.md). The eager function is the readable
# reference; tests hold the compiled one (inductor's C++ on a CPU: FUSED_DEVICES) to it.
FUSED_DEVICES = ("cuda",)


def fused(fn):
    """fn, run as its torch.compile'd twin (one kernel) where its first argument is on one of
    FUSED_DEVICES."""
    @functools.wraps(fn)
    def call(*args):
        if args[0].device.type not in FUSED_DEVICES:
            return fn(*args)
        if call.compiled is None:   # shapes dynamic: one kernel serves every bucket
            call.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return call.compiled(*args)
    call.eager, call.compiled = fn, None
    return call


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


rms_norm = fused(rms_norm_eager)


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual): a residual add and the norm after it, one kernel on
    CUDA. The residual first: the sum takes its memory layout, row-major from the embedding on, where
    x, a few-row projection's output, is a transposed view (Linear), which the next products read
    more slowly."""
    x = residual + x
    return rms_norm_eager(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/d) per pair of dimensions, with Llama 3's long-context rescaling when configured:
    long wavelengths are divided by `factor`, short ones kept, and the band between interpolated."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / s["low_freq_factor"], old_len / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    interpolated = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / s["factor"],
                       torch.where(wavelen < high_wavelen, inv_freq, interpolated))


class RotaryEmbedding(nn.Module):
    """Rotates each (i, i + d/2) pair of a head by position * inv_freq[i] (the "rotate half" layout)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        angles = positions[:, None] * rope_inverse_frequencies(config)[None, :]   # [max_pos, head_dim/2]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The reference: x [T, heads, head_dim] rotated at positions [T]."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]   # [T, 1, head_dim/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, head_dim] for rotate(): cos twice, and sin with its first half negated."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    @staticmethod
    @fused
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """forward() in 4 operations (one kernel on CUDA), with tables() made once per pass:
        x * cos + swap(x) * sin, swap exchanging the halves. The same float operations as forward,
        bit for bit: the first half is x1 * cos + x2 * (-sin), and a + (-b) is a - b exactly."""
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, input_size: int | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.qkv_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(input_size or h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=False)
        self.qk_norm = config.qk_norm   # Qwen3's
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        qk = qkv[:, :self.q_size + self.kv_size].view(tokens, heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        # q and k rotated together, with the pass's tables (the positions kept alive with them: the
        # key holds their id)
        cos, sin, _ = meta.once(("rope", id(rope), id(positions)),
                                lambda: (*rope.tables(positions), positions))
        # (a CPU's attention reads no page here)
        pages = kv_cache.layer(self.layer_index) if qk.is_cuda else None
        if pages is not None and triton_attention.available(qk, pages[0], meta):
            # the norms, the rotation and both writes in one kernel; the pages not unpacked: unbind's
            # views refuse in-place writes under autograd
            k_cache, v_cache = pages[0], pages[1]
            q = triton_attention.rotate_and_store(
                qk, v, cos, sin, k_cache, v_cache, meta.slot_mapping,
                *((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else ()))
            out = triton_attention.paged_attention(q, k_cache, v_cache, meta, scale=self.head_dim ** -0.5)
        else:
            if self.qk_norm:
                qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
            qk = rope.rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            out = paged_attention(q, k, v, kv_cache, self.layer_index, meta, scale=self.head_dim ** -0.5)
        return self.o_proj(out.reshape(tokens, -1))


@fused
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, positions, rope, kv_cache, meta):
        """x: the last layer's output, residual: its input (None before the first layer); their sum
        is the hidden state entering this layer, added inside the first norm (the residual stream as
        vLLM keeps it: each add joins the norm after it). Returns the same pair for the next layer."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


@dataclass
class ModelConfig:
    """The shapes and constants the layers read; checkpoint.read_config makes one from a config.json
    or a GGUF file's metadata, checking every field."""
    family: str                      # "llama", "qwen2" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


class CausalLM(nn.Module):
    """Decoder plus LM head. `forward` returns final hidden states; `logits` projects chosen rows."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()):
        """input_ids, positions: [T]. Returns normed hidden states [T, hidden] and, for each index i
        in capture_layers, the hidden state entering layer i (EAGLE-3's auxiliary features; i equal
        to the number of layers means the last layer's output before the final norm)."""
        x, residual = self.model.embed_tokens(input_ids), None
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture_layers:
                captured[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, positions, self.model.rotary, kv_cache, meta)
        hidden, captured[len(self.model.layers)] = self.model.norm(x, residual)
        return hidden, [captured[i] for i in capture_layers]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
