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
  the target's id d + d2t[d] (no d2t: the full vocabulary, as the EAGLE authors save it). Variants,
  as vLLM 0.32 reads their config flags (vllm/model_executor/models/llama_eagle3.py): `norm_before_fc`
  (`input_norm` over the 3H features), `fc_norm` (SpecForge's EAGLE-3.1: one norm per layer's chunk,
  `fc_norm.{0,1,2}`), `norm_before_residual` (the residual around attention is hidden_norm(feature),
  not the feature), `norm_output` (the normed state, not the pre-norm one, is fed to the next step).

A head may carry its own `embed_tokens` (EAGLE-1 releases save the target's, AngelSlim's may save
one): equal to the target's it is dropped, otherwise the head drafts with it, as its reference does.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from nanospec.checkpoint import (check_loadable, check_weights, for_inference, is_hub_id, load_safetensors,
                                 pack_weights, read_config, read_json, resolve, unpack_weights)
from nanospec.errors import NanospecError
from nanospec.cpu_linear import Linear
from nanospec.model import MLP, Attention, ModelConfig, RMSNorm, RotaryEmbedding


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3), in layer order (the order vLLM and SGLang concatenate them in, whatever the
    config lists; it differs only for targets of 4 layers or fewer)."""
    return tuple(sorted((2, num_layers // 2, num_layers - 3)))


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
        self.hot_ids = self.hot_head = None   # a token map's ids, and the LM head's rows of them

    def forward(self, embeds, features, positions, kv_cache, meta):
        """embeds, features: [T, H] -> the predicted next features [T, H]."""
        layer = self.layers[0]
        x = self.fc(torch.cat([embeds, features], dim=-1))
        x = x + layer.self_attn(x, positions, self.rotary, kv_cache, meta)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def carried(self, hidden):
        return hidden

    def logits(self, hidden, target) -> torch.Tensor:
        """The target's LM head on the un-normed prediction, as in EAGLE-1; with a token map, only its
        rows of the map's ids (-inf elsewhere)."""
        if self.hot_head is None:
            return target.logits(hidden)
        return to_target_vocab(self.hot_head(hidden).float(), self.hot_ids, target.config.vocab_size)

    def use_token_map(self, hot_ids: torch.Tensor, target) -> None:
        """Draft among `hot_ids` alone (FR-Spec, Zhao et al. 2025; SGLang's --speculative-token-map):
        a copy of the target LM head's rows of those ids, read in place of the whole head each step."""
        weight = target.lm_head.weight
        self.hot_ids = hot_ids.to(weight.device)
        self.hot_head = Linear(weight.shape[1], len(hot_ids), bias=False, device=weight.device,
                               dtype=weight.dtype).requires_grad_(False)
        self.hot_head.weight.copy_(weight[self.hot_ids])


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

    def __init__(self, config: ModelConfig, target_hidden: int, draft_vocab: int, target_vocab: int,
                 variants: dict | None = None):
        super().__init__()
        v = variants or {}
        self.config = config
        self.norm_before_residual = bool(v.get("norm_before_residual"))
        self.norm_output = bool(v.get("norm_output"))
        self.input_norm = RMSNorm(3 * target_hidden, config.rms_norm_eps) if v.get("norm_before_fc") else None
        self.fc_norm = nn.ModuleList([RMSNorm(target_hidden, config.rms_norm_eps) for _ in range(3)]) \
            if v.get("fc_norm") else None
        self.fc = Linear(3 * target_hidden, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))
        self.rotary = RotaryEmbedding(config)

    def combine(self, features):
        """The target's three layers' states [T, 3H] -> the head's input feature [T, H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            parts = features.chunk(3, dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)

    def forward(self, embeds, features, positions, kv_cache, meta):
        """embeds [T, H]; features [T, 3H] from the target (first step) or [T, H] from the head."""
        if features.shape[-1] != self.config.hidden_size:
            features = self.combine(features)
        m = self.midlayer
        normed = m.hidden_norm(features)
        both = torch.cat([m.input_layernorm(embeds), normed], dim=-1)
        residual = normed if self.norm_before_residual else features
        x = residual + m.self_attn(both, positions, self.rotary, kv_cache, meta)
        return x + m.mlp(m.post_attention_layernorm(x))

    def carried(self, hidden):
        """What the next draft step reads as its feature."""
        return self.norm(hidden) if self.norm_output else hidden

    def logits(self, hidden, target) -> torch.Tensor:
        """Logits over the target's vocabulary: -inf outside the draft vocabulary."""
        draft_logits = self.lm_head(self.norm(hidden)).float()
        target_ids = torch.arange(draft_logits.shape[-1], device=hidden.device) + self.d2t
        return to_target_vocab(draft_logits, target_ids, target.config.vocab_size)


def to_target_vocab(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [T, D] over a draft vocabulary (draft id d is target id target_ids[d]) -> [T, vocab_size],
    -inf at the ids outside it: the draft distribution q has no mass there."""
    full = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy(1, target_ids, draft_logits)


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The ids of a token map as SGLang reads one: a file of torch.save'd ids (a list or a 1-D integer
    tensor; the loader runs no pickled code), local or on the hub as OWNER/REPO/FILE. Returns them
    sorted, each once."""
    path = os.fspath(path)
    repo, name = os.path.split(path)
    if not os.path.exists(path):
        if not is_hub_id(repo):
            raise NanospecError(f"token map {path!r} not found: give a file of token ids or a hub path like "
                                "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt")
        path = os.path.join(resolve(repo, [name], "token map"), name)
    try:
        ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:
        raise NanospecError(f"token map {path} is not a torch.save'd list or tensor of token ids "
                            f"({type(e).__name__}); save one with torch.save(ids, PATH)") from e
    if ids.dim() != 1 or len(ids) == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise NanospecError(f"token map {path} holds a {ids.dtype} tensor of shape {list(ids.shape)}, not a "
                            "non-empty list of token ids; save one with torch.save(ids, PATH)")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise NanospecError(f"token map {path} has ids outside the target's vocabulary [0, {vocab_size}): it "
                            "was made for another model")
    return torch.unique(ids.long())


HEAD_FILES = ["*.json", "*.safetensors", "pytorch_model.bin"]
VARIANTS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def read_eagle_weights(folder: str) -> dict[str, torch.Tensor]:
    if not os.path.isdir(folder):
        raise NanospecError(f"EAGLE head {folder!r} not found: give a folder with config.json and "
                            "model.safetensors (or pytorch_model.bin), or a hub id")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if files:
        return load_safetensors([os.path.join(folder, f) for f in files])
    path = os.path.join(folder, "pytorch_model.bin")
    if os.path.exists(path):   # the original EAGLE-1 releases; tensors only, never pickled code
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise NanospecError(f"{path} is not a plain file of tensors ({type(e).__name__}: "
                                f"{str(e).splitlines()[0]}); nanospec never runs pickled code: use a "
                                "safetensors head") from e
        if not (isinstance(weights, dict) and all(isinstance(v, torch.Tensor) for v in weights.values())):
            raise NanospecError(f"{path} does not hold a dict of tensors; use a safetensors head")
        return weights
    raise NanospecError(f"no model.safetensors or pytorch_model.bin in EAGLE head folder {folder}")


def load_eagle_head(eagle: str, target, device: torch.device, dtype: torch.dtype,
                    token_map: str | None = None):
    """Read an EAGLE-1 or EAGLE-3 head (a folder or a hub id), check it fits `target`, return
    (head, aux_layers or None). An EAGLE-1 head drafts among a token map's ids, if given."""
    folder = resolve(eagle, HEAD_FILES, "EAGLE head", "a head folder or a Hugging Face hub id like "
                     "yuhuili/EAGLE-LLaMA3.1-Instruct-8B")
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
    config = read_config({**cfg, "architectures": ["Qwen2ForCausalLM" if has_bias else "LlamaForCausalLM"],
                          "num_hidden_layers": 1, "quantization_config": None,
                          "max_position_embeddings": target.config.max_position_embeddings},
                         source=config_path)
    check_fits(config, cfg, weights, version, target.config)
    check_rope(cfg, config_path, target.config.rope_theta)
    if version == 1:
        check_no_variants(cfg, config_path)
        head = Eagle1Head(config, fc_bias="fc.bias" in weights)
        aux = None
    else:
        aux = aux_layers(cfg, target.config.num_layers, config_path)
        head = Eagle3Head(config, target.config.hidden_size, weights["lm_head.weight"].shape[0],
                          target.config.vocab_size, variants(cfg, config_path))
    own_embedding(head, weights, target)
    load_into(head, weights, folder)
    check_trained_dtype(cfg, folder, dtype)
    head = head.to(device=device, dtype=dtype)
    head.rotary = RotaryEmbedding(config).to(device)   # float32 tables, as the target's (checkpoint.load)
    if token_map is not None:
        if version == 3:
            raise NanospecError(f"the EAGLE-3 head in {folder} drafts over its own vocabulary (d2t): a "
                                "token map is for EAGLE-1 heads; leave it out")
        head.use_token_map(load_token_map(token_map, target.config.vocab_size), target)
    return for_inference(head), aux


def variants(cfg: dict, source: str) -> dict:
    """EAGLE-3's variant flags, at the top level or in eagle_config (where vLLM also reads norm_before_fc)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    out = {name: cfg.get(name, nested.get(name, False)) for name in VARIANTS}
    bad = [name for name, value in out.items() if not isinstance(value, bool)]
    if bad:
        raise NanospecError(f"{source}: {bad[0]} must be true or false, got {out[bad[0]]!r}")
    if out["norm_output"]:
        warnings.warn(f"{source} sets norm_output: nanospec feeds the normed state to the next draft step, "
                      "as vLLM and SGLang read the flag; SpecForge's trainer means by it only the norm "
                      "before lm_head and feeds the pre-norm state; if the head came from SpecForge, set "
                      "norm_output to false",
                      stacklevel=4)
    return out


def check_no_variants(cfg: dict, source: str) -> None:
    named = [name for name in VARIANTS if cfg.get(name)]
    if named:
        raise NanospecError(f"{source}: {named[0]} is an EAGLE-3 variant, but this is an EAGLE-1 head "
                            "(fc over [embedding, hidden], layers.0.*); remove the flag")


def check_rope(cfg: dict, source: str, target_theta: float) -> None:
    """A head is trained with some rotary base; the config does not always say which (the EAGLE
    authors' EAGLE-3 configs give none and train with 10000; AngelSlim's trainer uses 10000 whatever
    its config says). nanospec, like vLLM and SGLang, uses the config's value, else 10000."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None and target_theta != 10000:
        warnings.warn(f"{source} gives no rope_theta: the head's rotary base is 10000, as the EAGLE authors "
                      f"train it; if it was trained with the target's ({target_theta:g}), add "
                      f"\"rope_theta\": {target_theta:g} to its config.json", stacklevel=4)
    elif "Eagle3LlamaForCausalLM" in (cfg.get("architectures") or []) and theta not in (None, 10000):
        warnings.warn(f"{source} looks like an AngelSlim head (Eagle3LlamaForCausalLM), whose trainer uses "
                      f"rotary base 10000 whatever the config says; nanospec uses the config's {theta:g}, as "
                      "vLLM and SGLang do; if few drafts are accepted, set \"rope_theta\": 10000 in its "
                      "config.json", stacklevel=4)


def own_embedding(head: nn.Module, weights: dict, target) -> None:
    """A head's embed_tokens equal to the target's is dropped (the target's is used); a different
    one is the head's own, as in its reference, which embeds with the checkpoint's copy."""
    embed = weights.get("embed_tokens.weight")
    if embed is None:
        return
    target_embed = target.model.embed_tokens.weight
    if (embed.shape == target_embed.shape
            and torch.equal(embed.to(target_embed.dtype), target_embed.detach().cpu())):
        del weights["embed_tokens.weight"]
    else:
        head.embed_tokens = nn.Embedding(*embed.shape)


# Which target layers an EAGLE-3 head reads, and what its numbers mean. nanospec's own meaning
# (model.py's capture_layers) is "the hidden state entering layer i" (the output of layer i - 1).
# - Top-level `eagle_aux_hidden_state_layer_ids`: vLLM's field, in that meaning (vllm 0.32
#   v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads it first;
#   models/llama.py collects hidden + residual after layer i - 1 for id i).
# - `eagle_config.eagle_aux_hidden_state_layer_ids`: what SpecForge and SGLang write and SGLang reads
#   (srt/model_executor/model_runner.py), meaning "the output of layer i": SGLang's llama.py
#   set_eagle3_layers_to_capture adds 1. So id i here is layer i + 1 in nanospec's meaning.
#   (vLLM 0.32 falls back to this field without adding 1: it reads such heads one layer early.)
# - AngelSlim's top-level `aux_hidden_states_layer_ids`: hidden_states[i + 1], the output of layer i.
# - None: (2, L//2, L-3), where the EAGLE authors capture (modeling_llama_kv.py), and both engines' default.
# nanospec's train_eagle.py before this rule wrote the nested field in nanospec's meaning; such a
# head is known by its `trained_target_dtype` and no top-level ids, and is read as it was meant.
def aux_layers(cfg: dict, num_layers: int, source: str) -> tuple[int, int, int]:
    """The three target layers whose inputs an EAGLE-3 head reads, in nanospec's meaning."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    top, inner = cfg.get("eagle_aux_hidden_state_layer_ids"), nested.get("eagle_aux_hidden_state_layer_ids")
    angelslim = cfg.get("aux_hidden_states_layer_ids")
    for ids, field in ((top, "eagle_aux_hidden_state_layer_ids"),
                       (inner, "eagle_config.eagle_aux_hidden_state_layer_ids"),
                       (angelslim, "aux_hidden_states_layer_ids")):
        if ids is not None and not (isinstance(ids, (list, tuple)) and len(ids) == 3
                                    and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise NanospecError(f"{source}: {field} must be three layer numbers, got {ids!r}")
    if top is not None:
        aux = tuple(top)
        if inner is not None and [i + 1 for i in inner] != list(top):
            warnings.warn(f"{source} names its EAGLE-3 layers twice, and the two disagree: top-level "
                          f"{list(top)} (vLLM's field: the states entering those layers) against "
                          f"eagle_config's {list(inner)} (SGLang's and SpecForge's: the outputs of those "
                          "layers); nanospec reads the top-level ids; if the head was trained by SpecForge "
                          "or SGLang, delete the top-level field",
                          stacklevel=4)
    elif inner is not None:
        legacy = "trained_target_dtype" in cfg   # an older nanospec head: see above
        aux = tuple(inner) if legacy else tuple(i + 1 for i in inner)
    elif angelslim is not None:
        aux = tuple(i + 1 for i in angelslim)
    else:
        aux = default_aux_layers(num_layers)
    if not all(0 <= i <= num_layers for i in aux):
        raise NanospecError(f"{source}: EAGLE-3 auxiliary layers {list(aux)} (the states entering them) are "
                            f"not layers of the {num_layers}-layer target; the head was trained for a "
                            "different model")
    return tuple(sorted(aux))   # both engines concatenate the states in layer order


def check_trained_dtype(cfg: dict, folder: str, dtype: torch.dtype) -> None:
    """A head learns the features of the target in the dtype it was trained with (train_eagle.py
    records it); served beside the target in another dtype it drafts worse (never wrongly)."""
    trained, serving = cfg.get("trained_target_dtype"), str(dtype).removeprefix("torch.")
    if trained and trained != serving:
        warnings.warn(f"EAGLE head {folder} was trained on the target's {trained} features but the target "
                      f"runs in {serving} here: expect fewer accepted drafts; run with --dtype {trained} "
                      f"(dtype={trained!r})",
                      stacklevel=3)


def check_fits(config: ModelConfig, cfg: dict, weights: dict, version: int, target: ModelConfig) -> None:
    """A head trained for another model fails here, with the reason, instead of deep inside a matmul."""
    fc_in = weights["fc.weight"].shape[1]
    expected_in = 2 * target.hidden_size if version == 1 else 3 * target.hidden_size
    if config.hidden_size != target.hidden_size or fc_in != expected_in:
        raise NanospecError(f"EAGLE-{version} head has hidden size {config.hidden_size} (fc input {fc_in}) "
                            f"but the target's hidden size is {target.hidden_size} (needs fc input "
                            f"{expected_in}); use a head trained for this target")
    embedding = weights.get("embed_tokens.weight")
    vocab = embedding.shape[0] if embedding is not None else cfg.get("vocab_size")
    if vocab is not None and vocab != target.vocab_size:
        raise NanospecError(f"EAGLE-{version} head's vocabulary has {vocab} tokens but the target's has "
                            f"{target.vocab_size}; use a head trained for this target")


def load_into(head: nn.Module, weights: dict[str, torch.Tensor], folder: str) -> None:
    """Check the tensors against the head's own and load them. t2d is optional (unused here); so is
    d2t when the draft vocabulary is the target's whole one (the EAGLE authors delete it then)."""
    expected = unpack_weights(dict(head.state_dict()), head.config)   # under the checkpoint's own names
    if "t2d" not in weights:
        expected.pop("t2d", None)
    if "d2t" in expected and "d2t" not in weights:
        if len(head.d2t) != len(head.t2d):
            raise NanospecError(f"EAGLE-3 head in {folder} drafts over {len(head.d2t)} tokens, not the "
                                f"target's {len(head.t2d)}, but has no d2t to map them; it is incomplete")
        expected.pop("d2t")
    source = f"EAGLE head in {folder}"
    check_loadable(weights, source, integer_names=("d2t", "t2d"))
    check_weights(expected, weights, source, "it is incomplete")
    if "d2t" in weights:
        target_ids = torch.arange(len(weights["d2t"])) + weights["d2t"]
        if int(target_ids.max()) >= head.t2d.shape[0] or int(target_ids.min()) < 0:
            raise NanospecError("EAGLE-3 head's d2t maps draft tokens outside the target's vocabulary; "
                                "use a head trained for this target")
    head.load_state_dict(pack_weights(weights), strict=False)
