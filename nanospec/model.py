"""The decoder of the Llama 3.x and Qwen 2 / 2.5 / 3 families, one class per box of the paper.

Differences between the families are flags on one config: Qwen2 adds a bias to q/k/v, Qwen3 an
RMSNorm on each head of q and k, Llama 3.x may scale RoPE ("llama3" rope_scaling), SmolLM2 and the
small Qwens tie the LM head to the embeddings. Parameter names follow the Hugging Face checkpoint
keys, except that q/k/v and gate/up are packed into one matrix each (`qkv_proj`, `gate_up_proj`):
one matmul instead of three or two, which is what a memory-bound decode step wants.

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
from nanospec.errors import NanospecError, check_int, check_real
from nanospec.kv_cache import AttentionMetadata, KVCache
from nanospec.kv_mirror import paged_attention

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
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

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Read a Hugging Face config.json (old `rope_theta`/`rope_scaling` and new `rope_parameters`),
        checking every field the model uses: a missing, mistyped or impossible one is refused here,
        naming `source`, instead of failing later inside torch."""
        if not isinstance(cfg, dict):
            raise NanospecError(f"{source} holds a JSON {type(cfg).__name__}, not an object of model settings; "
                                "re-download the checkpoint")
        archs = cfg.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else archs
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            raise NanospecError(
                f"unsupported architecture {arch!r} in {source}; nanospec supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 3.x, SmolLM2, Qwen 2 / 2.5 / 3)")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
            raise NanospecError(f"{source} describes a quantized checkpoint ({method}); nanospec loads float32, "
                                "bfloat16 and float16 safetensors (and GGUF files): use the unquantized model")
        for name, supported in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                                ("use_sliding_window", False)):
            if cfg.get(name, supported) != supported or type(cfg.get(name, supported)) is not type(supported):
                raise NanospecError(f"{source}: {name} {cfg[name]!r} is not supported (Llama and Qwen use "
                                    f"{supported!r}); this is not a checkpoint nanospec can run")
        value = lambda name, default=None: default if cfg.get(name) is None else cfg[name]
        size = lambda name, default=None, low=1: check_int(value(name, default), f"{source}: {name}", low,
                                                           fix="fix the file or re-download the checkpoint")
        hidden, heads = size("hidden_size"), size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        if heads % kv_heads:
            raise NanospecError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                                f"{kv_heads}; fix the file or re-download the checkpoint")
        # without head_dim: hidden / heads, but Qwen3's 128 (transformers' Qwen3Config default)
        qwen3 = SUPPORTED_ARCHITECTURES.get(arch) == "qwen3"
        if cfg.get("head_dim") is None and hidden % heads and not qwen3:
            raise NanospecError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                                "and no head_dim is given; fix the file or re-download the checkpoint")
        head_dim = size("head_dim", 128 if qwen3 else hidden // heads)
        if head_dim % 2:
            raise NanospecError(f"{source}: head_dim {head_dim} is odd; rotary embeddings rotate pairs of dimensions")
        real = lambda name, default: check_real(value(name, default), f"{source}: {name}", above=0, fix="fix the file")
        rope = {} if cfg.get("rope_parameters") is None else cfg["rope_parameters"]
        if not isinstance(rope, dict):
            raise NanospecError(f"{source}: rope_parameters must be an object, got {rope!r}")
        # transformers 5 writes rope_parameters (theta and scaling), older versions the top-level keys;
        # a config that has both, disagreeing, is ambiguous (transformers reads them either way).
        if rope and cfg.get("rope_scaling") is not None and rope_kind(cfg["rope_scaling"]) != rope_kind(rope):
            raise NanospecError(f"{source} has rope_scaling and rope_parameters that disagree; keep one (rope_parameters)")
        if cfg.get("rope_theta") is not None and rope.get("rope_theta", cfg["rope_theta"]) != cfg["rope_theta"]:
            raise NanospecError(f"{source} has rope_theta {cfg['rope_theta']!r} and rope_parameters.rope_theta "
                                f"{rope['rope_theta']!r}; keep one")
        # transformers 5 reads an old rope_scaling as rope_parameters, its rope_theta included
        old = cfg.get("rope_scaling") if not rope and isinstance(cfg.get("rope_scaling"), dict) else {}
        if cfg.get("rope_theta") is not None and old.get("rope_theta", cfg["rope_theta"]) != cfg["rope_theta"]:
            raise NanospecError(f"{source} has rope_theta {cfg['rope_theta']!r} and rope_scaling.rope_theta "
                                f"{old['rope_theta']!r}; keep one")
        theta = real("rope_theta", rope.get("rope_theta", old.get("rope_theta", 10000.0)))
        return cls(
            family=SUPPORTED_ARCHITECTURES[arch], vocab_size=size("vocab_size"), hidden_size=hidden,
            intermediate_size=size("intermediate_size"), num_layers=size("num_hidden_layers"), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=real("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=read_rope_scaling(cfg, rope, source),
            max_position_embeddings=size("max_position_embeddings", 4096, low=2),
            tie_word_embeddings=read_bool(cfg, "tie_word_embeddings", source),
            bos_token_id=None if cfg.get("bos_token_id") is None else size("bos_token_id", low=0),
            eos_token_ids=read_token_ids(cfg.get("eos_token_id"), f"{source}: eos_token_id"))


def read_bool(cfg: dict, name: str, source: str) -> bool:
    value = False if cfg.get(name) is None else cfg[name]
    if not isinstance(value, bool):
        raise NanospecError(f"{source}: {name} must be true or false, got {value!r}; fix the file")
    return value


def read_token_ids(value, name: str) -> list[int]:
    """An eos_token_id field: absent, one id or a list of ids (a string can never match a token)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        check_int(token, name, low=0, fix="token ids are integers; fix the file")
    return list(ids)


def rope_kind(scaling) -> object:
    """A rope scaling dict without its theta, and with `type` spelled `rope_type`: two spellings of
    the same scaling compare equal."""
    if not isinstance(scaling, dict):
        return scaling
    kind = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    kind.setdefault("rope_type", scaling.get("type", "default"))
    return kind


LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_rope_scaling(cfg: dict, rope: dict, source: str) -> dict | None:
    """Llama 3's rope scaling with its four numbers, or None (no scaling); anything else is refused."""
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise NanospecError(f"{source}: rope_scaling must be an object, got {scaling!r}; fix the file")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise NanospecError(f"unsupported rope scaling {scaling!r} in {source}; nanospec supports 'llama3' scaling")
    for name in LLAMA3_ROPE_FIELDS:
        check_real(scaling.get(name), f"{source}: rope_scaling.{name}", above=0, fix="llama3 scaling needs all of "
                   + ", ".join(LLAMA3_ROPE_FIELDS))
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise NanospecError(f"{source}: rope_scaling.high_freq_factor must be above low_freq_factor, got "
                            f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}; fix the file")
    return scaling


PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pack_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this model's: concatenate q/k/v and gate/up along the output rows."""
    packed = dict(weights)
    for name in list(weights):
        for fused, parts in PACKED.items():
            prefix, dot, suffix = name.partition(f".{parts[0]}.")
            if dot:
                pieces = [f"{prefix}.{p}.{suffix}" for p in parts]
                if all(p in weights for p in pieces):
                    packed[f"{prefix}.{fused}.{suffix}"] = torch.cat([weights[p] for p in pieces])
                    for p in pieces:
                        del packed[p]
    return packed


def unpack_weights(weights: dict[str, torch.Tensor], config: "ModelConfig") -> dict[str, torch.Tensor]:
    """The inverse of pack_weights: this model's fused q/k/v and gate/up rows split back into Hugging Face's names."""
    rows = {"qkv_proj": [config.num_heads * config.head_dim] + [config.num_kv_heads * config.head_dim] * 2,
            "gate_up_proj": [config.intermediate_size] * 2}
    unpacked = {}
    for name, tensor in weights.items():
        fused = next((f for f in PACKED if f".{f}." in name), None)
        if fused is None:
            unpacked[name] = tensor
        else:
            for part, piece in zip(PACKED[fused], tensor.split(rows[fused])):
                unpacked[name.replace(fused, part)] = piece
    return unpacked


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


# On CUDA the small elementwise pieces of a layer (an RMSNorm with the residual add before it, the
# rotation of q and k, SiLU-and-mul) each run as one kernel that torch.compile makes of the function,
# as nano-vllm compiles its small layers: in a captured graph that is one node where eager PyTorch
# launches 4-8. On a CPU the functions run eagerly: there a compiled function's call costs more
# (20-30 us, docs/performance.md) than the few ops it would fuse. The eager function is the
# readable reference; tests hold the compiled one (inductor's C++ on a CPU: FUSED_DEVICES) to it.
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
    """(rms_norm(x + residual), x + residual): a residual add and the norm after it, one kernel on CUDA.
    The residual first: the sum takes its memory layout, row-major from the embedding on, where x, a
    few-row projection's output, is a transposed view (Linear), which the next products read 4x slower."""
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


class Linear(nn.Linear):
    """nn.Linear with CPU fast paths for inference on the few rows of a decode or verify step.

    torch's plain CPU F.linear (x @ W.T) reads the weight in a way that suits large batches; for a
    few rows it is several times slower than it could be, and its time jumps about with the row
    count. For 1-2 rows W @ x.T (one row padded to two) is the fastest; for more, oneDNN on a copy of
    W packed once into its blocked layout (torch.ops.mkldnn, what torch.compile's CPU freezing uses).
    Same math, other kernels; the measurements are in docs/performance.md.

    The packed copy (as much memory again as the weight) is made on first use and remade when the
    weight changes (a new tensor or an in-place update moves the key); the weight stays the
    parameter (state_dict, training and the GPU see a plain nn.Linear). Anything that needs a
    gradient, other dtypes and devices take F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or not x.dtype == self.weight.dtype == torch.float32 or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        n = x.shape[0]   # (not len(x): Tensor.__len__ is Python, 1-2 us a call in a hot path)
        if x.dim() == 2 and n <= 2:
            # rows row-major, so that rows.T is the transposed view MKL multiplies fast (W @ a row-major
            # [K, 2] is 4x slower); one row padded by cat, one op (repeat is four on torch 2.13)
            rows = x.contiguous() if n == 2 else torch.cat([x, x])
            out = (self.weight @ rows.T).T[:n]
            return out if self.bias is None else out + self.bias
        if not PACKED_LINEAR:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")

    def packed_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_packed", (None,))[0] != key:
            with torch.inference_mode(False), torch.no_grad():   # a normal tensor, usable in any mode
                self._packed = key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return self._packed[1]


PACKED_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, input_size: int | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
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
        norms = self.qk_norm
        # q and k rotated together, with the pass's tables (the positions kept alive with them: the key
        # holds their id)
        cos, sin, _ = meta.once(("rope", id(rope), id(positions)), lambda: (*rope.tables(positions), positions))
        pages = kv_cache.layer(self.layer_index) if qk.is_cuda else None   # (the CPU's attention reads no page here)
        if pages is not None and triton_attention.available(qk, pages[0]):   # the norms, the rotation and both writes in one kernel
            k_cache, v_cache = pages[0], pages[1]   # (not unpacked: unbind's views refuse in-place writes under autograd)
            q = triton_attention.rotate_and_store(
                qk, v, cos, sin, k_cache, v_cache, meta.slot_mapping,
                *((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if norms else ()))
            out = triton_attention.paged_attention(q, k_cache, v_cache, meta, scale=self.head_dim ** -0.5)
        else:
            if norms:
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
        h, residual = self.post_attention_layernorm(self.self_attn(h, positions, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


def for_inference(model: nn.Module) -> nn.Module:
    """The model in eval mode with no parameter requiring grad: every loaded model, draft model and
    EAGLE head is made so, so that no step (nor a CUDA graph's capture) records an autograd graph.
    (An in-place KV write under autograd links the pool to every activation that fed it, and keeps
    them all alive.) train_eagle.py trains a head it builds itself, not a loaded one."""
    return model.requires_grad_(False).eval()


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
