"""The front door never breaks: every malformed file and bad parameter ends in one NanospecError that
names the problem (or, where nanospec accepts the input, in correct output), never in another
exception type, a hang or silently wrong tokens; and a failed call leaves the LLM as it was.

Each case copies a small valid checkpoint (or EAGLE head), breaks one thing in it with a helper,
and loads it the way a user would."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import Planted, assert_no_leak
from nanospec import LLM, NanospecError, SamplingParams
from nanospec.cuda_graph import StepOptions
from nanospec.sampling_params import MIN_TEMPERATURE
from nanospec.request import hit_stop_string

PROMPT = "The quick brown fox"
KV = dict(device="cpu", dtype="float32", kv_cache_gb=0.02)


def greedy(max_tokens=6):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- helpers that break one thing in a copy of a valid folder ----

def json_edit(name, change):
    """change(data) edits the parsed JSON file in place."""
    def mutate(folder):
        path = os.path.join(folder, name)
        data = json.load(open(path))
        change(data)
        json.dump(data, open(path, "w"))
    return mutate


def config(**fields):
    """config.json with these fields set."""
    return json_edit("config.json", lambda cfg: cfg.update(fields))


def drop(name, *keys):
    return json_edit(name, lambda data: [data.pop(key, None) for key in keys])


def replace_json(name, value):
    return lambda folder: json.dump(value, open(os.path.join(folder, name), "w"))


def write(name, content: bytes | str):
    def mutate(folder):
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(os.path.join(folder, name), mode) as f:
            f.write(content)
    return mutate


def remove(*names):
    def mutate(folder):
        for name in names:
            os.remove(os.path.join(folder, name))
    return mutate


def weights(change):
    """change(tensors) edits the dict of model.safetensors in place."""
    def mutate(folder):
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        change(tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    return mutate


def tokenizer_model(change):
    """change(model) edits tokenizer.json's BPE model section in place."""
    return json_edit("tokenizer.json", lambda data: change(data["model"]))


Q = "model.layers.0.self_attn.q_proj.weight"

# (id, mutation of the target folder, what the error names; None: it loads and generates correctly)
CHECKPOINT_CASES = [
    ("config missing hidden_size", drop("config.json", "hidden_size"),
     "hidden_size is missing|hidden_size must"),
    ("config missing heads", drop("config.json", "num_attention_heads"), "num_attention_heads"),
    ("config missing vocab_size", drop("config.json", "vocab_size"), "vocab_size"),
    ("config missing intermediate_size", drop("config.json", "intermediate_size"), "intermediate_size"),
    ("config missing layers", drop("config.json", "num_hidden_layers"), "num_hidden_layers"),
    ("config missing architectures", drop("config.json", "architectures"), "unsupported architecture"),
    ("hidden_size a string", config(hidden_size="64"), "hidden_size must be an integer"),
    ("hidden_size a fraction", config(hidden_size=64.5), "hidden_size must be an integer"),
    ("hidden_size negative", config(hidden_size=-64), "hidden_size must be an integer >= 1"),
    ("zero layers", config(num_hidden_layers=0), "num_hidden_layers must be an integer >= 1"),
    ("zero heads", config(num_attention_heads=0), "num_attention_heads must be an integer >= 1"),
    ("heads not a multiple of kv heads", config(num_key_value_heads=3),
     "not a multiple of num_key_value_heads"),
    ("odd head_dim", config(head_dim=15), "head_dim 15 is odd"),
    ("layers as a bool", config(num_hidden_layers=True), "num_hidden_layers must be an integer"),
    ("2^33 positions", config(max_position_embeddings=2**33), None),
    ("one position", config(max_position_embeddings=1), "max_position_embeddings must be an integer >= 2"),
    ("llama3 scaling without factor", json_edit("config.json", lambda c: c["rope_parameters"].pop("factor")),
     "rope_scaling.factor"),
    ("llama3 scaling with equal factors", json_edit("config.json", lambda c: c["rope_parameters"].update(
        high_freq_factor=1.0)), "high_freq_factor must be above"),
    ("rope scaling a string", config(rope_scaling="llama3", rope_parameters=None),
     "rope_scaling must be an object"),
    ("unknown rope scaling", config(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "unsupported rope scaling"),
    ("rope_scaling beside rope_parameters", config(rope_scaling={"rope_type": "default"}), "that disagree"),
    ("rope_theta 0", json_edit("config.json", lambda c: c["rope_parameters"].update(rope_theta=0)),
     "rope_theta must be a finite number > 0"),
    ("two rope_thetas", config(rope_theta=10000.0), "has rope_theta 10000.0 and rope_parameters.rope_theta"),
    ("negative rms_norm_eps", config(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number > 0"),
    ("eos a string", config(eos_token_id="2"), "eos_token_id must be an integer"),
    ("eos list with a string", config(eos_token_id=[2, "<|im_end|>"]), "eos_token_id must be an integer"),
    ("negative bos", config(bos_token_id=-1), "bos_token_id must be an integer >= 0"),
    ("tie as a string", config(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
    ("unsupported architecture", config(architectures=["GPT2LMHeadModel"]), "unsupported architecture"),
    ("architectures a dict", config(architectures=[{"name": "x"}]), "unsupported architecture"),
    ("fp8 quantization_config", config(quantization_config={"quant_method": "fp8"}),
     r"quantized checkpoint \(fp8\)"),
    ("config a JSON list", replace_json("config.json", [1, 2]), "holds a JSON list, not a JSON dict"),
    ("config not JSON", write("config.json", "{hidden_size: 64"), "is not valid JSON"),
    ("config not UTF-8", write("config.json", b"\xff\xfe\x00{"), "is not valid JSON"),
    ("config missing", remove("config.json"), "missing config.json"),
    ("generation_config eos a string", write("generation_config.json", '{"eos_token_id": "x"}'),
     "generation_config.json: eos_token_id must be an integer"),
    ("generation_config temperature negative", write("generation_config.json", '{"temperature": -0.5}'),
     "generation_config.json: temperature must be a finite number >= 0.*generation_config vllm"),
    ("generation_config top_p 0", write("generation_config.json", '{"top_p": 0}'),
     r"generation_config.json: top_p must be in \(0, 1\]"),
    ("generation_config top_k a float", write("generation_config.json", '{"top_k": 2.5}'),
     "generation_config.json: top_k must be an integer"),
    ("generation_config max_new_tokens 0", write("generation_config.json", '{"max_new_tokens": 0}'),
     "generation_config.json: max_new_tokens must be an integer >= 1"),
    ("generation_config sampling nulls",
     write("generation_config.json", '{"temperature": null, "top_k": -1}'), None),
    ("1 layer config, 2 layers of weights", config(num_hidden_layers=1),
     "tensors its config has no place for"),
    ("3 layer config, 2 layers of weights", config(num_hidden_layers=3), "lacks .* tensors"),
    ("wider config", config(hidden_size=128), "has shape .* but the config implies"),
    ("smaller vocab_size", config(vocab_size=10), "has shape .* but the config implies"),
    ("no weights", remove("model.safetensors"), r"no \*.safetensors weights"),
    ("weights not safetensors", write("model.safetensors", b"\x00" * 64), "not a readable safetensors file"),
    ("index without weight_map", write("model.safetensors.index.json", '{"metadata": {}}'), "no weight_map"),
    ("index naming a missing shard", write("model.safetensors.index.json",
                                           '{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'),
     "missing weight shard"),
    ("a tensor missing", weights(lambda t: t.pop(Q)), "lacks 1 tensors"),
    ("a tensor mis-shaped", weights(lambda t: t.update({Q: t[Q][:, :-1]})), "has shape"),
    ("an extra tensor", weights(lambda t: t.update({"model.extra.weight": torch.zeros(2)})), "no place for"),
    ("integer weights", weights(lambda t: t.update({Q: (t[Q] * 100).to(torch.int8)})), "is int8: integer"),
    ("fp8 weights", weights(lambda t: t.update({Q: t[Q].to(torch.float8_e4m3fn)})),
     "float8_e4m3fn: FP8-quantized"),
    ("fp8 weight_scale", weights(lambda t: t.update({Q.replace(".weight", ".weight_scale"): torch.ones(1)})),
     "is quantized"),
    ("bfloat16 weights", weights(lambda t: t.update({k: v.bfloat16() for k, v in t.items()})), None),
    # NaN weights are found by the prefill, in the K/V it writes
    ("NaN weights", weights(lambda t: t[Q].fill_(float("nan"))), "target model produced NaN or infinite K/V"),
    ("tokenizer missing", remove("tokenizer.json"), "no tokenizer.json or tokenizer.model"),
    ("tokenizer not JSON", write("tokenizer.json", "{"), "tokenizer.json is not valid JSON"),
    ("tokenizer a JSON list", replace_json("tokenizer.json", []), "holds a JSON list"),
    ("tokenizer without model", drop("tokenizer.json", "model"), "has no model section"),
    ("tokenizer WordPiece", tokenizer_model(lambda m: m.update(type="WordPiece")),
     "has WordPiece model section"),
    ("tokenizer without merges", tokenizer_model(lambda m: m.pop("merges")),
     "lacks a vocab object or a merges list"),
    ("tokenizer without vocab", tokenizer_model(lambda m: m.pop("vocab")), "lacks a vocab object"),
    ("merge without a space", tokenizer_model(lambda m: m["merges"].__setitem__(0, "ab")), "merge 0 is 'ab'"),
    ("merge of three", tokenizer_model(lambda m: m["merges"].__setitem__(0, ["a", "b", "c"])), "merge 0 is"),
    ("vocab id a string", tokenizer_model(lambda m: m["vocab"].update(a="7")), "maps 'a' to '7'"),
    ("vocab id huge", tokenizer_model(lambda m: m["vocab"].update(a=10**12)), "not a token id"),
    ("added_tokens not a list", json_edit("tokenizer.json", lambda d: d.update(added_tokens={"a": 1})),
     "added_tokens must be a list"),
    ("tokenizer_config not JSON", write("tokenizer_config.json", "{,}"),
     "tokenizer_config.json is not valid JSON"),
    ("tokenizer.model garbage",
     lambda f: (remove("tokenizer.json")(f), write("tokenizer.model", "not base64 at all\n")(f)),
     r"tokenizer.model:1 is not a `base64-token rank` line"),
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid 2-layer Llama 3 checkpoint (rope scaling, untied head) and its greedy output."""
    from conftest import write_checkpoint
    folder = write_checkpoint(str(tmp_path_factory.mktemp("valid") / "llama3"), "llama3", seed=11)
    return folder, LLM(folder, **KV).generate(PROMPT, greedy())[0].token_ids


@pytest.mark.parametrize("name,mutate,match", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_malformed_checkpoint(valid, tmp_path, name, mutate, match):
    folder, expected = valid
    broken = shutil.copytree(folder, str(tmp_path / "broken"))
    mutate(broken)
    if match is None:   # accepted: then it must generate what the valid checkpoint does
        assert LLM(broken, **KV).generate(PROMPT, greedy())[0].token_ids == expected
        return
    with pytest.raises(NanospecError, match=match) as error:
        LLM(broken, **KV).generate(PROMPT, greedy())
    assert "\n" not in str(error.value)


# ---- EAGLE heads ----

def eagle3(change):
    """change(tensors, cfg) edits an EAGLE-3 head's tensors and config in place."""
    def mutate(folder):
        path, cfg_path = os.path.join(folder, "model.safetensors"), os.path.join(folder, "config.json")
        tensors, cfg = load_file(path), json.load(open(cfg_path))
        change(tensors, cfg)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        json.dump(cfg, open(cfg_path, "w"))
    return mutate


def planted_pickle(folder):
    os.remove(os.path.join(folder, "model.safetensors"))
    torch.save({"fc.weight": torch.zeros(2, 2), "x": Planted(os.path.join(folder, "RAN"))},
               os.path.join(folder, "pytorch_model.bin"))


EAGLE_CASES = [
    ("eagle3 without lm_head", eagle3(lambda t, c: t.pop("lm_head.weight")),
     "lacks the matrix lm_head.weight"),
    ("eagle3 without fc", eagle3(lambda t, c: t.pop("fc.weight")), "lacks the matrix fc.weight"),
    ("eagle3 with two aux layers", eagle3(lambda t, c: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]})), "must be three layer numbers"),
    ("eagle3 aux layer past the target", eagle3(lambda t, c: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 99]})),
     "are not layers of the 4-layer target"),
    ("eagle3 t2d of the wrong length", eagle3(lambda t, c: t.update(t2d=t["t2d"][:-1])),
     "tensor t2d has shape"),
    ("eagle3 d2t as floats", eagle3(lambda t, c: t.update(d2t=t["d2t"].float())),
     "floats where token ids belong"),
    ("eagle3 d2t out of range", eagle3(lambda t, c: t["d2t"].add_(10**6)), "d2t maps draft tokens outside"),
    ("eagle3 config without heads", eagle3(lambda t, c: c.pop("num_attention_heads")), "num_attention_heads"),
    ("eagle3 config a list", write("config.json", "[]"), "holds a JSON list"),
    ("eagle3 without config", remove("config.json"), "missing config.json"),
    ("eagle3 a midlayer tensor missing", eagle3(lambda t, c: t.pop("midlayer.mlp.up_proj.weight")),
     "lacks 1 tensors"),
    ("eagle3 integer weights", eagle3(lambda t, c: t.update({"midlayer.mlp.up_proj.weight": torch.ones(
        t["midlayer.mlp.up_proj.weight"].shape, dtype=torch.int32)})), "integer"),
    ("eagle3 an extra tensor", eagle3(lambda t, c: t.update({"midlayer.extra": torch.ones(3)})),
     "no place for"),
    ("eagle3 pickle with code", planted_pickle, "never runs pickled code"),
    ("eagle3 empty folder", lambda f: [os.remove(os.path.join(f, n)) for n in os.listdir(f)],
     "no model.safetensors"),
]


@pytest.mark.parametrize("name,mutate,match", EAGLE_CASES, ids=[c[0] for c in EAGLE_CASES])
def test_malformed_eagle_head(spec_models, tmp_path, name, mutate, match):
    broken = shutil.copytree(spec_models["eagle3"], str(tmp_path / "head"))
    mutate(broken)
    with pytest.raises(NanospecError, match=match) as error:
        LLM(spec_models["target"], eagle=broken, **KV)
    assert "\n" not in str(error.value)
    assert not os.path.exists(os.path.join(broken, "RAN"))   # no pickled code ran


# ---- GGUF metadata (the offline SmolLM2 file's, with one thing broken) ----

@pytest.fixture(scope="module")
def gguf_meta(smollm2_gguf):
    from nanospec import gguf_file
    return gguf_file.metadata(gguf_file.open_reader(smollm2_gguf))


def gguf_load(meta):
    """What read_checkpoint and load_tokenizer do with a GGUF file's metadata, before the weights."""
    from nanospec import gguf_file
    from nanospec.checkpoint import read_config
    from nanospec.tokenizer import from_gguf
    read_config(gguf_file.hf_config(meta, "model.gguf"), source="the metadata of model.gguf")
    from_gguf(meta)


def without(*keys):
    return lambda meta: {k: v for k, v in meta.items() if k not in keys}


def with_(**fields):
    return lambda meta: {**meta, **{k.replace("__", "."): v for k, v in fields.items()}}


GGUF_CASES = [
    ("no embedding_length", without("llama.embedding_length"),
     "lacks the GGUF metadata key llama.embedding_length"),
    ("no head_count", without("llama.attention.head_count"), "llama.attention.head_count"),
    ("no block_count", without("llama.block_count"), "llama.block_count"),
    ("no feed_forward_length", without("llama.feed_forward_length"), "llama.feed_forward_length"),
    ("no vocabulary", without("tokenizer.ggml.tokens", "llama.vocab_size"), "neither llama.vocab_size nor"),
    ("no merges", without("tokenizer.ggml.merges"), "lacks a complete tokenizer"),
    ("no token types", without("tokenizer.ggml.token_type"), "lacks a complete tokenizer"),
    ("unknown architecture", with_(general__architecture="gpt2"), "unsupported GGUF architecture 'gpt2'"),
    ("sentencepiece tokenizer", with_(tokenizer__ggml__model="llama"),
     "GGUF tokenizer 'llama' is not supported"),
    ("unknown pre-tokenizer", with_(tokenizer__ggml__pre="mystery"), "pre-tokenizer 'mystery'"),
    ("eos out of range", with_(tokenizer__ggml__eos_token_id=10**9), "names token id 1000000000"),
    ("zero heads", with_(llama__attention__head_count=0), "num_attention_heads must be an integer >= 1"),
    ("negative context", with_(llama__context_length=-5), "max_position_embeddings must be"),
    ("rope base 0", with_(llama__rope__freq_base=0.0), "rope_theta must be a finite number > 0"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,change,match", GGUF_CASES, ids=[c[0] for c in GGUF_CASES])
def test_malformed_gguf_metadata(gguf_meta, name, change, match):
    gguf_load(gguf_meta)   # the untouched metadata loads
    with pytest.raises(NanospecError, match=match):
        gguf_load(change(gguf_meta))


# ---- parameters ----

LLM_PARAM_CASES = [
    (dict(num_kv_blocks=0), "num_kv_blocks must be an integer >= 1"),
    (dict(num_kv_blocks=-3), "num_kv_blocks must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer in 1..1024"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (dict(kv_cache_gb=0), "kv_cache_gb must be a finite number > 0"),
    (dict(kv_cache_gb=float("nan")), "kv_cache_gb must be a finite number"),
    (dict(kv_cache_gb=1e6), r"needs .* GiB but cpu has .* GiB free"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 2"),
    (dict(max_model_len=10**6), "above the 512 positions"),
    (dict(max_model_len=400, num_kv_blocks=4, block_size=16), "does not fit in the KV cache, which holds 64"),
    (dict(ngram=True, ngram_min=0), "ngram_min must be an integer >= 1"),
    (dict(ngram=True, ngram_min=3, ngram_max=2), "ngram_max must be an integer >= 3"),
    (dict(suffix=True, suffix_max_spec_offset=-1), "suffix_max_spec_offset must be an integer in 0..16"),
    (dict(ngram=True, suffix_max_spec_offset=3),
     "suffix_max_spec_offset is a setting of suffix decoding: add suffix"),
    (dict(suffix=True, suffix_max_cached_requests=-1), "suffix_max_cached_requests must be an integer >= 0"),
    (dict(suffix=True, suffix_max_cached_requests=1.5), "suffix_max_cached_requests must be an integer >= 0"),
    (dict(suffix=True, suffix_max_spec_factor=-0.5),
     r"suffix_max_spec_factor must be a finite number in \[0, 16\]"),
    (dict(suffix=True, suffix_max_spec_factor=1e308),
     r"suffix_max_spec_factor must be a finite number in \[0, 16\]"),
    (dict(suffix=True, suffix_max_spec_factor=float("inf")),
     "suffix_max_spec_factor must be a finite number"),
    (dict(suffix=True, suffix_min_token_prob=1.5),
     r"suffix_min_token_prob must be a finite number in \[0, 1\]"),
    (dict(suffix=True, suffix_min_token_prob=float("nan")), "suffix_min_token_prob must be a finite number"),
    (dict(suffix_min_token_prob=0.2), "suffix_min_token_prob is a setting of suffix decoding: add suffix"),
    (dict(compile_sampler="yes"), "compile_sampler must be True or False"),
    (dict(ngram="yes"), "ngram must be True or False"),
    (dict(device="tpu"), "unknown device 'tpu'"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(ngram=True, num_speculative_tokens=0), "must be an integer in 1..16"),
    (dict(draft=5), "draft must be a path"),
    (dict(ngram=True, speculative_disable_queue_size=-1),
     "speculative_disable_queue_size must be an integer >= 0"),
    (dict(speculative_disable_queue_size=4), "speculative_disable_queue_size needs a proposer"),
]


@pytest.mark.parametrize("kwargs,match", LLM_PARAM_CASES, ids=[str(k) for k, _ in LLM_PARAM_CASES])
def test_bad_llm_parameter(checkpoints, kwargs, match):
    with pytest.raises(NanospecError, match=match):
        LLM(checkpoints["qwen3"], **{**KV, **kwargs})


def test_an_unknown_llm_keyword_is_refused_as_python_refuses_it(checkpoints):
    """LLM's keywords are its records' fields (EngineOptions, EngineSizes, SpeculativeConfig): a
    misspelt one is a TypeError, before anything loads; so is a size given by position."""
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'num_kv_block'"):
        LLM(checkpoints["qwen3"], **KV, num_kv_block=4)
    with pytest.raises(TypeError, match="positional argument"):
        LLM(checkpoints["qwen3"], "cpu", "float32", 64)


SAMPLING_CASES = [
    (dict(temperature=1e-39), "too small to sample with"),
    (dict(temperature=MIN_TEMPERATURE / 2), "too small to sample with"),
    (dict(temperature=-1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(temperature=float("inf")), "temperature must be"),
    (dict(temperature="hot"), "temperature must be"),
    # too large for a float: refused as a bad value, not an OverflowError
    (dict(temperature=10**400), "temperature must be"),
    (dict(repetition_penalty=10**400), "repetition_penalty must be"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_p=float("nan")), "top_p must be in"),
    (dict(top_k=-1), "top_k must be an integer in 0.."),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_k=2**63), "top_k must be an integer in 0.."),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(seed=2**63), r"seed must be an integer in 0..9223372036854775807"),
    (dict(seed=-1), "seed must be an integer in"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(stop=[5]), "stop must be a string or a list of strings"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop=[""]), "stop holds an empty string"),
    (dict(stop=""), "stop holds an empty string"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
]


@pytest.mark.parametrize("kwargs,match", SAMPLING_CASES, ids=[str(k) for k, _ in SAMPLING_CASES])
def test_bad_sampling_parameter_leaves_the_llm_as_it_was(tiny_llm, kwargs, match):
    # one good request beside the bad one
    params = [greedy(), SamplingParams(**{"temperature": 0.7, **kwargs})]
    with pytest.raises(NanospecError, match=match):
        tiny_llm.generate(["hello", "world"], params)
    assert_no_leak(tiny_llm)


def test_the_smallest_temperature_samples(tiny_llm):
    """Both sides of MIN_TEMPERATURE: at it, sampling is finite and (the logits being far apart) greedy."""
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=MIN_TEMPERATURE, max_tokens=6, seed=1,
                                                   ignore_eos=True))
    assert out[0].token_ids == tiny_llm.generate(PROMPT, greedy())[0].token_ids


GENERATE_CASES = [
    (dict(prompts=5), "prompts must be a string"),
    (dict(prompts=[None]), "prompt 0 must be text or a list of token ids"),
    (dict(prompts=[[-1, 3]]), "holds token id -1"),
    (dict(prompts=[[10**9]]), "holds token id 1000000000"),
    (dict(prompts=[[1.5]]), "holds token id 1.5"),
    (dict(prompts=["a", "b"], params=[greedy()]), "got 1 SamplingParams for 2 prompts"),
    (dict(prompts=["a"], params={"temperature": 0}), "params must be a SamplingParams"),
    (dict(prompts=[""]), "prompt 0 is empty"),
]


@pytest.mark.parametrize("kwargs,match", GENERATE_CASES, ids=[str(k) for k, _ in GENERATE_CASES])
def test_bad_generate_call(tiny_llm, kwargs, match):
    with pytest.raises(NanospecError, match=match):
        tiny_llm.generate(kwargs["prompts"], kwargs.get("params", greedy()))
    assert_no_leak(tiny_llm)


def test_there_are_at_least_sixty_malformed_inputs():
    cases = [CHECKPOINT_CASES, EAGLE_CASES, GGUF_CASES, LLM_PARAM_CASES, SAMPLING_CASES, GENERATE_CASES]
    assert sum(1 for table in cases for case in table if case[-1] is not None) >= 60


# ---- config.json mutated at random: refused with a NanospecError, or equal to transformers ----

def hf_greedy(folder, prompt_ids, n):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


# The keys whose values change the model (the rest, like transformers_version, nanospec rightly ignores).
READ_KEYS = {"architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
             "rope_scaling", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
             "eos_token_id", "hidden_act", "attention_bias", "mlp_bias", "rope_parameters"}
MUTATIONS = {
    "delete": lambda v: None,
    "string": lambda v: str(v),
    "fraction": lambda v: v + 0.5 if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.5,
    "negate": lambda v: -v if isinstance(v, (int, float)) and not isinstance(v, bool) else -1,
    "zero": lambda v: 0,
    "list": lambda v: [v],
    "null": lambda v: "null",
}


def mutate_config(folder: str, root, changes: dict) -> tuple[str, dict]:
    """A copy of the checkpoint whose config.json has `changes` ({key: mutation name}) applied."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    for key, how in changes.items():
        new = MUTATIONS[how](cfg.get(key))
        if new is None:
            cfg.pop(key, None)
        else:
            cfg[key] = None if new == "null" else new
    broken = shutil.copytree(folder, str(root / "ckpt"))
    json.dump(cfg, open(os.path.join(broken, "config.json"), "w"))
    return broken, cfg


def refused_or_correct(broken: str, cfg: dict, changes: dict) -> str:
    """Loading the mutated checkpoint gives a NanospecError that names a changed key (or the config),
    or output equal to transformers' on the same folder; returns which."""
    try:
        llm = LLM(broken, **KV)
    except NanospecError as e:
        assert any(key in str(e) for key in changes) or "architecture" in str(e) or "tensor" in str(e), str(e)
        return "refused"
    for key in [k for k, v in cfg.items() if v is None]:   # nanospec reads a null field as an absent one (its
        del cfg[key]                                         # default); so must the oracle
    json.dump(cfg, open(os.path.join(broken, "config.json"), "w"))
    ids = llm.tokenizer.encode(PROMPT)
    assert llm.generate([ids], greedy(4))[0].token_ids == hf_greedy(broken, ids, 4), changes
    return "accepted"


@pytest.mark.parametrize("key", sorted(READ_KEYS))
@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_every_single_config_mutation_is_refused_or_loads_correctly(valid, tmp_path, key, how):
    broken, cfg = mutate_config(valid[0], tmp_path, {key: how})
    refused_or_correct(broken, cfg, {key: how})


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(sorted(READ_KEYS)), st.sampled_from(sorted(MUTATIONS)),
                               min_size=2, max_size=3))
def test_mutated_configs_are_refused_or_load_correctly(valid, tmp_path_factory, changes):
    """Two or three fields mutated at once (delete a key, change its type, negate or zero a size, ...)."""
    broken, cfg = mutate_config(valid[0], tmp_path_factory.mktemp("mutated"), changes)
    event(refused_or_correct(broken, cfg, changes))


# ---- a failed call leaves the LLM as it was ----

SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=i, ignore_eos=True)
           for i in range(4)]
PROMPTS = ["The quick brown fox", "def add(a, b):", "1234567890 numbers", "It was the best of times"]


def fail_at_step(n, error):
    steps = []

    def on_step(requests):
        steps.append(requests)
        if len(steps) == n:
            raise error
    return on_step


@pytest.mark.slow
def test_a_failed_generate_leaves_the_llm_as_a_fresh_one(spec_models, monkeypatch):
    """Mid-run failures of every kind (an exception from a callback, Ctrl-C, an error inside the
    sampler, a bad parameter) and then a normal call: the same output as a fresh LLM, no leaked
    block in the target's or the draft's pool, and stats that count only the call itself."""
    build = lambda: LLM(spec_models["target"], draft=spec_models["draft"], num_speculative_tokens=3,
                        max_num_seqs=2, **KV)   # max_num_seqs 2: some requests still wait when it fails
    expected = [o.token_ids for o in build().generate(PROMPTS, SAMPLED)]
    llm = build()
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, SAMPLED, on_step=fail_at_step(3, RuntimeError("injected")))
    assert_no_leak(llm)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, SAMPLED, on_step=fail_at_step(5, KeyboardInterrupt()))
    assert_no_leak(llm)
    real = llm.engine.sampler.rejection_sample
    calls = []
    monkeypatch.setattr(llm.engine.sampler, "rejection_sample",
                        lambda *a, **kw: (calls.append(1), real(*a, **kw) if len(calls) < 4 else 1 / 0)[1])
    with pytest.raises(ZeroDivisionError):
        llm.generate(PROMPTS, SAMPLED)
    monkeypatch.setattr(llm.engine.sampler, "rejection_sample", real)
    assert_no_leak(llm)
    with pytest.raises(NanospecError, match="seed must be"):
        llm.generate(PROMPTS, SAMPLED[:3] + [SamplingParams(seed=2**63)])
    assert_no_leak(llm)
    outputs = llm.generate(PROMPTS, SAMPLED)
    assert [o.token_ids for o in outputs] == expected
    assert llm.stats["generated_tokens"] == sum(len(t) for t in expected)   # none left from the failures
    assert_no_leak(llm)


@pytest.mark.parametrize("mirror", [False, True])   # mirror off: the pool written layer by layer, as on CUDA
def test_a_pass_that_raises_midway_leaves_no_kv_behind(checkpoints, monkeypatch, mirror):
    """A prefill that raises after layer 0 has written NaN K/V (a poisoned embedding row, then an
    error in layer 0's MLP) fails the call; the blocks it wrote are free again, and the next call
    must find the pool as a fresh LLM's: all finite, the same output. Without the caches cleared,
    the reference attention left layer 0's NaN in the freed blocks."""
    options = StepOptions(pad_batches=True, kv_mirror=mirror)
    build = lambda: LLM(checkpoints["llama3"], max_num_seqs=1, step_options=options, **KV)
    expected = build().generate([[5, 6, 7, 8, 9]], greedy())[0].token_ids
    llm = build()
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[200] = float("nan")
    mlp = llm.model.model.layers[0].mlp
    monkeypatch.setattr(mlp, "forward", lambda x: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        llm.generate([[200] + list(range(10, 40))], greedy())
    monkeypatch.undo()
    assert torch.isfinite(llm.engine.kv_cache.pool).all()
    assert_no_leak(llm)
    assert llm.generate([[5, 6, 7, 8, 9]], greedy())[0].token_ids == expected


def test_a_prefill_that_writes_nan_fails_its_request_at_once(checkpoints):
    """A prompt whose prefill writes NaN K/V (a poisoned embedding row) fails in that step, the
    caches cleared: a request that left before its first decode step (a client gone) used to leave
    its blocks to the pool with their NaN, which the next request read masked and failed on."""
    llm = LLM(checkpoints["llama3"], max_num_seqs=1, **KV)
    expected = llm.generate([[5, 6, 7, 8, 9]], greedy())[0].token_ids
    good = llm.model.model.embed_tokens.weight[200].clone()
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[200] = float("nan")
    engine = llm.engine
    bad = engine.new_request(0, "", [200] + list(range(10, 40)), greedy())
    engine.add_requests([bad])
    engine.step()   # its prefill
    assert bad.finish_reason == "error" and "NaN or infinite K/V" in bad.error
    engine.abort([bad])   # (what a client that left does; nothing once it failed)
    assert torch.isfinite(engine.kv_cache.pool).all()
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[200] = good
    assert llm.generate([[5, 6, 7, 8, 9]], greedy())[0].token_ids == expected
    assert_no_leak(llm)


def test_the_default_context_is_what_the_kv_cache_holds(checkpoints):
    """Without max_model_len, a KV cache smaller than the model's positions (512) sets the context
    (64 tokens): a request asking for all of it runs, where it was refused as needing more cache than
    the pool holds (a chat's default max_tokens asks for the whole context). Given explicitly, a
    max_model_len the cache cannot hold is refused (above)."""
    llm = LLM(checkpoints["llama3"], num_kv_blocks=4, block_size=16, device="cpu", dtype="float32")
    assert llm.max_model_len == 64
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    assert LLM(checkpoints["llama3"], **KV).max_model_len == 512   # a cache that holds the positions: theirs


def test_nan_logits_are_an_error_and_the_llm_recovers(checkpoints):
    """A step whose logits are not finite stops the call with the likely causes; once the weights
    are right again, the same LLM generates as before."""
    llm = LLM(checkpoints["qwen3"], **KV)
    expected = llm.generate(PROMPTS, greedy())
    weight = llm.model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("inf")
    with pytest.raises(NanospecError,
                       match="target model produced NaN or infinite (logits|K/V) .* run in float32"):
        llm.generate(PROMPTS, greedy())
    assert_no_leak(llm)
    with torch.no_grad():
        weight.copy_(saved)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [o.token_ids for o in expected]


def test_nan_draft_logits_are_an_error(spec_models):
    llm = LLM(spec_models["target"], draft=spec_models["draft"], **KV)
    with torch.no_grad():
        llm.engine.proposer.model.model.norm.weight.fill_(float("nan"))
    with pytest.raises(NanospecError, match="draft model produced NaN"):
        llm.generate(PROMPTS, SAMPLED)
    assert_no_leak(llm)


# ---- stop strings ----

def test_a_stop_at_the_start_returns_the_empty_string(tiny_llm):
    full = tiny_llm.generate(PROMPT, greedy(12))[0]
    first = tiny_llm.tokenizer.decode(full.token_ids[:1])
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[first]))[0]
    assert out.text == "" and out.finish_reason == "stop"


def test_one_stop_string_is_one_stop_not_its_characters(tiny_llm):
    """stop="xyz" stops at "xyz", not at the first x, y or z: pick a stop one of whose characters
    comes earlier in the text than the stop itself."""
    text = tiny_llm.generate(PROMPT, greedy(24))[0].text
    stop = next(text[i:i + 3] for i in range(1, len(text) - 3)
                if text[i:i + 3].strip()
                and any(c in text[:text.index(text[i:i + 3])] for c in text[i:i + 3]))
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=stop))[0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"


def test_the_text_ends_before_the_earliest_of_several_stops(tiny_llm):
    text = tiny_llm.generate(PROMPT, greedy(24))[0].text
    early, late = text[4:6], text[10:13]
    assume_distinct = text.index(early) < text.index(late)
    assert assume_distinct
    out = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=[late, early]))[0]
    assert out.text == text[:text.index(early)]


# ---- found in review ----

def test_a_quick_profile_fits_a_small_kv_pool(checkpoints):
    """The quick dynamic-K profile runs on engines of its own; with a small pool (so short position
    tables) its prompts are cut to fit, or, where nothing fits, one clear line."""
    llm = LLM(checkpoints["qwen3"], ngram=True, dynamic_k=True, num_speculative_tokens=2, max_num_seqs=2,
              num_kv_blocks=24, block_size=16, **{k: v for k, v in KV.items() if k != "kv_cache_gb"})
    assert llm.generate(PROMPT, greedy())[0].token_ids
    with pytest.raises(NanospecError, match="too small: give a measured profile"):
        LLM(checkpoints["qwen3"], ngram=True, dynamic_k=True, max_num_seqs=1, num_kv_blocks=4, block_size=16,
            **{k: v for k, v in KV.items() if k != "kv_cache_gb"})


def test_devices_and_dtypes_may_be_torch_objects(checkpoints):
    llm = LLM(checkpoints["qwen3"], device=torch.device("cpu"), dtype=torch.float32, kv_cache_gb=0.02)
    assert llm.generate(PROMPT, greedy())[0].token_ids
    with pytest.raises(NanospecError, match="device must be auto, cpu or cuda"):
        LLM(checkpoints["qwen3"], device=3, kv_cache_gb=0.02)


def test_agreeing_rope_scaling_and_rope_parameters_load(valid, tmp_path):
    folder, expected = valid
    broken = shutil.copytree(folder, str(tmp_path / "both"))
    cfg = json.load(open(os.path.join(broken, "config.json")))
    cfg["rope_scaling"] = {k if k != "rope_type" else "type": v for k, v in cfg["rope_parameters"].items()
                           if k != "rope_theta"}
    json.dump(cfg, open(os.path.join(broken, "config.json"), "w"))
    assert LLM(broken, **KV).generate(PROMPT, greedy())[0].token_ids == expected


@pytest.mark.slow
def test_output_text_leaves_out_special_tokens_as_transformers_decodes(checkpoints, tmp_path):
    """An output's text leaves out the special tokens, as vLLM's skip_special_tokens (default true)
    and transformers' decode(skip_special_tokens=True) do; an added token not marked special (here
    <|im_start|>, as Qwen3's <think>) stays; skip_special_tokens=False keeps them all. token_ids
    keep every token. The random model samples special tokens among the others."""
    from transformers import AutoTokenizer
    folder = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        token["special"] = token["content"] != "<|im_start|>"
    (folder / "tokenizer.json").write_text(json.dumps(data))
    hf = AutoTokenizer.from_pretrained(folder)
    llm = LLM(str(folder), **KV)
    specials = {t["id"]: t["special"] for t in data["added_tokens"]}
    for seed in range(20):   # a sample with a special token and the added one that is not special
        params = dict(temperature=1.0, max_tokens=150, ignore_eos=True, seed=seed)
        out = llm.generate("a", SamplingParams(**params))[0]
        if {True, False} <= {specials[i] for i in out.token_ids if i in specials}:
            break
    assert {True, False} <= {specials[i] for i in out.token_ids if i in specials}
    assert out.text == hf.decode(out.token_ids, skip_special_tokens=True)
    kept = llm.generate("a", SamplingParams(**params, skip_special_tokens=False))[0]
    assert (kept.token_ids == out.token_ids
            and kept.text == hf.decode(out.token_ids, skip_special_tokens=False))
    assert len(kept.text) > len(out.text) and "<|im_start|>" in out.text
    with pytest.raises(NanospecError, match="skip_special_tokens must be True or False"):
        llm.generate("a", SamplingParams(skip_special_tokens="no"))


def test_the_stop_check_reads_back_bytes_not_tokens():
    """The stop check decodes the output's end as its text has it: a skipped special token adds no
    bytes, so the end it reads reaches as many bytes back, not as many tokens."""
    from nanospec.tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    ids = list(b"ab") + [256] * 5 + list(b"cd")
    assert (tok.tail(ids, 3, skip_special=True) == ids[1:]
            and tok.decode(tok.tail(ids, 3, True), True) == "bcd")
    assert tok.tail(ids, 3) == ids[-3:] and tok.tail(ids, 5, True) == ids   # <|endoftext|> is 13 bytes kept


def test_an_output_cut_mid_character_leaves_the_character_out(tiny_llm):
    """A random model's output cut by max_tokens often ends inside a multi-byte character: its text
    leaves those bytes out, as vLLM's detokenizer does (transformers' decode ends it with U+FFFD)."""
    import codecs
    cut = 0
    for seed in range(30):
        out = tiny_llm.generate("a", SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True,
                                                    seed=seed))[0]
        data = tiny_llm.tokenizer.decode_bytes(out.token_ids, skip_special=True)
        assert out.text == codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)
        cut += tiny_llm.tokenizer.decode(out.token_ids, skip_special=True) != out.text
    assert cut   # some outputs did end mid-character


def test_stop_token_ids_and_include_stop_str_in_output_as_vllm(tiny_llm):
    """A stop token ends the output as EOS does (finish "stop", kept in token_ids, its text left
    out); include_stop_str_in_output keeps the stop token's or the stop string's text in the text,
    as vLLM's detokenizer does. The greedy output without them is the oracle."""
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    full = tiny_llm.generate([[5, 6, 7]], SamplingParams(**greedy))[0]
    tok = tiny_llm.tokenizer
    at = next(i for i, t in enumerate(full.token_ids)
              if i >= 3 and tok.decode([t]).strip() and t not in full.token_ids[:i])
    stop = full.token_ids[at]
    for include in (False, True):
        out = tiny_llm.generate([[5, 6, 7]], SamplingParams(**greedy, stop_token_ids=[stop],
                                                            include_stop_str_in_output=include))[0]
        assert out.token_ids == full.token_ids[:at + 1] and out.finish_reason == "stop"
        assert out.text == tok.output_text(full.token_ids[:at + include])
    text = tok.output_text(full.token_ids)
    word = text[len(text) // 2:len(text) // 2 + 2]
    for include in (False, True):
        out = tiny_llm.generate([[5, 6, 7]], SamplingParams(**greedy, stop=[word],
                                                            include_stop_str_in_output=include))[0]
        assert out.text == text[:text.find(word) + include * len(word)] and out.finish_reason == "stop"
    for bad in ("7", [1.5], [-1]):
        with pytest.raises(NanospecError, match="stop_token_ids"):
            tiny_llm.generate("a", SamplingParams(stop_token_ids=bad))


@pytest.mark.parametrize("proposer", ["plain", "ngram", "self_draft"])
def test_penalties_are_vllms_at_every_position(spec_models, proposer):
    """repetition, frequency and presence penalties, greedy: the tokens of a float64 loop over
    transformers' logits that applies them as vLLM does (repetition on the prompt's and the
    output's tokens, the other two on the output's), with or without drafts: a self-draft proposes
    the unpenalized argmax, so its accepted drafts put verify positions j > 0 to the test."""
    from transformers import AutoModelForCausalLM
    from conftest import proposer_args
    reference = AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32)
    prompt, rep, freq, pres = [5, 6, 7, 8, 5, 6], 1.3, 0.4, 0.3
    ids, out = list(prompt), []
    for _ in range(20):
        with torch.no_grad():
            x = reference(torch.tensor([ids])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(x)).double()
        seen = counts > 0
        penalized = seen.clone()
        penalized[prompt] = True
        x = (torch.where(penalized, torch.where(x > 0, x / rep, x * rep), x)
             - freq * counts - pres * seen.double())
        out.append(int(x.argmax()))
        ids.append(out[-1])
    spec_args = {} if proposer == "plain" else proposer_args(spec_models, proposer)
    llm = LLM(spec_models["target"], **KV, **spec_args)
    params = dict(temperature=0, max_tokens=20, ignore_eos=True)
    got = llm.generate([prompt], SamplingParams(**params, repetition_penalty=rep, frequency_penalty=freq,
                                                presence_penalty=pres))[0]
    assert got.token_ids == out
    if proposer == "self_draft":   # drafts were accepted: positions past the first were penalized too
        assert llm.stats["mean_acceptance_length"] > 1.5
    assert llm.generate([prompt], SamplingParams(**params))[0].token_ids != out   # they changed something
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=8, seed=1, presence_penalty=1.5,
                             frequency_penalty=-0.5)
    unpenalized = SamplingParams(temperature=0.8, max_tokens=8, seed=2)
    assert len(llm.generate([prompt, [9, 9, 9]], [sampled, unpenalized])[0].token_ids) == 8
    for bad, match in ((dict(repetition_penalty=0), "repetition_penalty must be"),
                       (dict(repetition_penalty=1e-300), "repetition_penalty must be"),
                       (dict(presence_penalty=2.5), "presence_penalty"),
                       (dict(frequency_penalty=float("nan")), "frequency_penalty")):
        with pytest.raises(NanospecError, match=match):
            llm.generate([prompt], SamplingParams(**bad))


def test_min_p_drops_what_is_less_likely_than_min_p_of_the_most_likely(spec_models):
    """min_p = 0.3 at T = 1.5, with n-gram drafts: every sampled token's probability at its position
    (transformers' logits at the temperature) is at least 0.3 of the most likely's; without min_p the
    same seeds sample tokens below it (so the test can fail). Greedy ignores it."""
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32)
    llm = LLM(spec_models["target"], **KV, ngram=True)
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11]]

    def lowest_ratio(min_p):
        lowest = 1.0
        for seed, prompt in enumerate(prompts):
            out = llm.generate([prompt], SamplingParams(temperature=1.5, min_p=min_p, max_tokens=24,
                                                        seed=seed, ignore_eos=True))[0]
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + out.token_ids])).logits
                logits = logits[0, len(prompt) - 1:-1].double()
            probs = torch.softmax(logits / 1.5, dim=-1)
            ratio = probs.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0] / probs.max(-1).values
            lowest = min(lowest, ratio.min().item())
        return lowest
    assert lowest_ratio(0.3) >= 0.3 - 1e-4
    assert lowest_ratio(0.0) < 0.3
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate(prompts, SamplingParams(**greedy, min_p=0.9))[0].token_ids == \
        llm.generate(prompts, SamplingParams(**greedy))[0].token_ids
    with pytest.raises(NanospecError, match="min_p must be"):
        llm.generate(prompts, SamplingParams(min_p=1.5))


def test_of_two_stops_one_token_completes_the_first_to_end_wins(tiny_llm):
    """One token completing two stop strings: the text ends at the one that ends first (the first
    listed of a tie), as vLLM's check_stop_strings chooses, before it or (include_stop_str_in_output)
    after it; before, the one that started first won. The stop check of a request whose newest
    token is a word of 3+ characters, "...X" + "abc": stops "Xabc" (starts first, ends last) and "ab"."""
    from types import SimpleNamespace
    tok = tiny_llm.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog and the cat")

    def stops(at):   # neither is in the text before the newest token (else it would have stopped there)
        before, piece = tok.decode(ids[:at]), tok.decode([ids[at]])
        ends_last, ends_first = before[-1] + piece, piece[:2]
        text = before + piece
        fits = (len(piece) >= 3 and text.find(ends_last) == len(before) - 1
                and text.find(ends_first) == len(before))
        return (at, before, piece, ends_first, ends_last) if fits else None
    at, before, piece, ends_first, ends_last = next(stops(i) for i in range(1, len(ids)) if stops(i))
    for include in (False, True):
        req = SimpleNamespace(output_ids=ids[:at + 1], text=None, params=SamplingParams(
            stop=[ends_last, ends_first], include_stop_str_in_output=include))
        req.params.validate()
        assert hit_stop_string(req, tiny_llm.tokenizer)
        assert req.text == (before + piece[:2] if include else before)


def test_integer_sampling_values_sample_as_their_floats(tiny_llm):
    """A client's JSON may send `"temperature": 1, "top_p": 1` or `"repetition_penalty": 2`: Python
    ints. They travel to the device as float64 bits (cuda_graph's pack_rows and
    logits_processors.process): a batch of only ints made an int array there, whose bits read as
    float64 are ~0, so temperature 1
    sampled greedily and a penalty of 2 divided by 0. Each must sample as its float does."""
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for ints, floats in ((dict(temperature=1, top_p=1), dict(temperature=1.0, top_p=1.0)),
                         (dict(temperature=1, top_p=1, repetition_penalty=2, frequency_penalty=1,
                               presence_penalty=0, min_p=0),
                          dict(temperature=1.0, top_p=1.0, repetition_penalty=2.0, frequency_penalty=1.0,
                               presence_penalty=0.0, min_p=0.0))):
        out = {}
        for name, values in (("ints", ints), ("floats", floats)):
            params = [SamplingParams(**values, seed=s, max_tokens=16, ignore_eos=True) for s in range(2)]
            out[name] = [o.token_ids for o in tiny_llm.generate(prompts, params)]
        assert out["ints"] == out["floats"]
    greedy_params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    greedy = [o.token_ids for o in tiny_llm.generate(prompts, greedy_params)]
    assert out["floats"] != greedy
