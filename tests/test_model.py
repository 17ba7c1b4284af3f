"""The decoder computes what the reference implementation computes: logits of each family against
transformers in float64, over prefill chunks and multi-token steps through the paged cache."""
import os

import pytest
import torch

from nanospec import checkpoint
from nanospec import cpu_linear, model as model_module
from nanospec.errors import NanospecError
from nanospec.kv_cache import KVCache, build_metadata


def reference_logits(folder: str, ids: list[int]) -> torch.Tensor:
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def our_logits(model, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run one sequence through the paged cache in chunks of the given sizes; logits of every token."""
    cfg = model.config
    cache = KVCache(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    table, done, out = [], 0, []
    for n in chunks:
        cache.allocator.grow(table, done + n)
        meta = build_metadata([table], [done], [n], 4, torch.device("cpu"))
        with torch.no_grad():
            hidden, _ = model(torch.tensor(ids[done:done + n]), torch.arange(done, done + n), cache, meta)
            out.append(model.logits(hidden))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_logits_match_transformers_float64(checkpoints, family):
    folder = checkpoints[family]
    model = checkpoint.build_model(checkpoint.read_checkpoint(folder), torch.device("cpu"), torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (90,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    expected = reference_logits(folder, ids)
    # prefill in uneven chunks, then a 5-token (verify-like) step and single-token decode steps
    got = our_logits(model, ids, [37, 40, 5, 1, 1, 1, 1, 1, 1, 1, 1])
    assert (got.double() - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_the_fused_pieces_compiled_compute_what_the_eager_ones_do(checkpoints, family, monkeypatch):
    """What CUDA runs compiled, one kernel each (model.fused: a residual add with the RMSNorm after
    it, the rotation of q and k, SiLU-and-mul; Qwen3's q/k norms), compiled here by inductor for the
    CPU: the logits match transformers in float64 as the eager pieces' do, and the eager pieces'
    own within float32 rounding."""
    folder = checkpoints[family]
    model = checkpoint.build_model(checkpoint.read_checkpoint(folder), torch.device("cpu"), torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (50,),
                        generator=torch.Generator().manual_seed(2)).tolist()
    chunks = [37, 5, 1, 1, 1, 1, 1, 1, 1, 1]
    eager = our_logits(model, ids, chunks)
    pieces = [model_module.rms_norm, model_module.add_rms_norm, model_module.RotaryEmbedding.rotate,
              model_module.silu_and_mul]
    monkeypatch.setattr(model_module, "FUSED_DEVICES", ("cpu", "cuda"))
    for piece in pieces:
        monkeypatch.setattr(piece, "compiled", None)
    compiled = our_logits(model, ids, chunks)
    assert all(piece.compiled is not None for piece in pieces)   # each ran compiled
    assert (compiled.double() - reference_logits(folder, ids)).abs().max().item() < 1e-4
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_is_applied(checkpoints):
    """The fixture's llama3 rope scaling changes the frequencies (so the test above covers it)."""
    from nanospec.model import rope_inverse_frequencies
    cfg = checkpoint.read_checkpoint(checkpoints["llama3"]).config
    scaled = rope_inverse_frequencies(cfg)
    cfg.rope_scaling = None
    assert not torch.allclose(scaled, rope_inverse_frequencies(cfg))


def test_a_rope_theta_inside_rope_scaling_is_read_as_transformers_reads_it(checkpoints, tmp_path):
    """An older config with its theta inside rope_scaling (no rope_parameters, no top-level theta):
    transformers 5 reads rope_scaling as rope_parameters, theta included (not the default 10000)."""
    import json
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(checkpoints["llama3"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"], cfg["rope_parameters"] = cfg["rope_parameters"], None
    cfg.pop("rope_theta", None)
    assert cfg["rope_scaling"]["rope_theta"] == 500000.0
    (folder / "config.json").write_text(json.dumps(cfg))
    model = checkpoint.build_model(checkpoint.read_checkpoint(str(folder)),
                                   torch.device("cpu"), torch.float32)
    assert model.config.rope_theta == 500000.0
    ids = torch.randint(3, model.config.vocab_size, (90,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    got = our_logits(model, ids, [80] + [1] * 10)
    assert (got.double() - reference_logits(str(folder), ids)).abs().max().item() < 1e-4
    cfg["rope_theta"] = 10000.0   # and a top-level theta that disagrees: ambiguous, refused
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanospecError, match="rope_scaling.rope_theta"):
        checkpoint.read_checkpoint(str(folder))


def test_a_qwen3_config_without_head_dim_takes_transformers_default(tmp_path):
    """Qwen3Config's head_dim defaults to 128, not hidden / heads: a config.json without it loads as
    transformers loads it."""
    import json
    import transformers
    config = transformers.Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=72,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg.pop("head_dim") == 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = checkpoint.build_model(checkpoint.read_checkpoint(str(tmp_path)),
                                   torch.device("cpu"), torch.float32)
    assert model.config.head_dim == 128
    ids = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = our_logits(model, ids, [30] + [1] * 10)
    assert (got.double() - reference_logits(str(tmp_path), ids)).abs().max().item() < 1e-4


def converter_rope_freqs(theta: float, head_dim: int, scaling: dict) -> list[float]:
    """What llama.cpp's convert_hf_to_gguf.py writes as rope_freqs for a "llama3" rope_scaling
    (LlamaModel.generate_extra_tensors): a divisor per frequency, computed in float32."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high, old = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                    "original_max_position_embeddings"))
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        smooth = (old / wavelength - low) / (high - low)
        divisors.append(1 if wavelength < old / high else factor if wavelength > old / low
                        else 1 / ((1 - smooth) / factor + smooth))
    return divisors


def write_llama_gguf(folder: str, path: str, rope_freqs: list[float] | None) -> None:
    """A Hugging Face Llama folder as llama.cpp's converter writes it: its metadata, q and k rows
    permuted, rope_freqs."""
    import json
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    cfg = checkpoint.read_config(json.load(open(os.path.join(folder, "config.json"))))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        w = w.float().numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if module in ("self_attn.q_proj", "self_attn.k_proj"):   # llama.cpp's permute: pairs (0, 1), ...
                heads = cfg.num_heads if module == "self_attn.q_proj" else cfg.num_kv_heads
                pairs = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                w = pairs.swapaxes(1, 2).reshape(w.shape)
            name = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_gguf_keeps_its_rope_scaling(tmp_path):
    """llama.cpp writes Llama 3.1 / 3.2's "llama3" rope scaling as a rope_freqs tensor, not as
    metadata: the GGUF's logits are transformers' on the Hugging Face folder it came from (they were
    computed unscaled, far off, before), and the config recovers the scaling's parameters."""
    import numpy as np
    from conftest import FAMILIES, write_checkpoint
    from nanospec import gguf_file
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    # the fixture's own scaling (transformers adds the theta to the dict it is given)
    assert {k: v for k, v in FAMILIES["llama3"]["rope_scaling"].items() if k != "rope_theta"} == scaling
    # heads of 64: 3 frequencies in the band
    folder = write_checkpoint(str(tmp_path / "hf"), "llama3", hidden=256)
    write_llama_gguf(folder, str(tmp_path / "m.gguf"), converter_rope_freqs(500000.0, 64, scaling))
    loaded = checkpoint.read_checkpoint(str(tmp_path / "m.gguf"))
    assert loaded.config.rope_scaling == scaling
    model = checkpoint.build_model(loaded, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (90,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    got = our_logits(model, ids, [40, 30, 5] + [1] * 15)
    assert (got.double() - reference_logits(folder, ids)).abs().max().item() < 1e-4
    # Llama 3.1 (factor 8) and 3.2 (factor 32), head 128: the parameters come back exactly
    for factor in (8.0, 32.0):
        real = dict(scaling, factor=factor, original_max_position_embeddings=8192)
        freqs = np.array(converter_rope_freqs(500000.0, 128, real))
        assert gguf_file.llama3_scaling(freqs, 500000.0, 128, "x") == real


def test_a_gguf_rope_scaling_nanospec_cannot_read_is_refused(tmp_path, checkpoints):
    """A rope_freqs that is not Llama 3's scaling, or llama.cpp's linear / yarn scaling: one line."""
    import gguf
    write_llama_gguf(checkpoints["llama3"], str(tmp_path / "odd.gguf"),
                     [1.0, 3.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(NanospecError, match="rope_freqs tensor .* is not Llama 3's RoPE scaling"):
        checkpoint.read_checkpoint(str(tmp_path / "odd.gguf"))
    from nanospec import gguf_file
    meta = gguf_file.metadata(gguf.GGUFReader(str(tmp_path / "odd.gguf")))
    with pytest.raises(NanospecError, match="scales RoPE by 'yarn'"):
        gguf_file.hf_config({**meta, "llama.rope.scaling.type": "yarn"})


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers(smollm2_gguf):
    """Our GGUF reader + model vs transformers' own GGUF loader + LlamaForCausalLM, 32 greedy tokens."""
    from nanospec import LLM, SamplingParams
    from nanospec.bench import transformers_model   # a thin wrapper over transformers' GGUF loader
    llm = LLM(device="cpu", dtype="float32", kv_cache_gb=0.1)
    prompt = "The three primary colors are"
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids
    ref = transformers_model(smollm2_gguf, torch.float32, torch.device("cpu"))
    assert type(ref).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([llm.tokenizer.encode(prompt)])
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ours == out[0, ids.shape[1]:].tolist()
    assert len(ours) == 32


def test_unsupported_architecture_is_named(tmp_path, checkpoints):
    import json
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(checkpoints["qwen2"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanospecError,
                       match="unsupported architecture 'MistralForCausalLM'.*Qwen3ForCausalLM"):
        checkpoint.read_checkpoint(str(folder))


def test_sharded_checkpoint_loads(tmp_path, checkpoints):
    """A sharded checkpoint with model.safetensors.index.json loads to the same weights."""
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"])
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    a = checkpoint.read_checkpoint(checkpoints["qwen3"]).weights
    b = checkpoint.read_checkpoint(str(tmp_path)).weights
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hub_id_resolves_from_local_cache_offline(tmp_path, monkeypatch, checkpoints):
    """A hub id finds a model in the huggingface_hub cache with HF_HUB_OFFLINE=1 (no network)."""
    import shutil
    snapshot = tmp_path / "models--tiny--qwen3" / "snapshots" / ("a" * 40)
    shutil.copytree(checkpoints["qwen3"], snapshot)
    (tmp_path / "models--tiny--qwen3" / "refs").mkdir()
    (tmp_path / "models--tiny--qwen3" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    assert checkpoint.resolve("tiny/qwen3") == str(snapshot)


@pytest.mark.parametrize("few_rows_by_mkl", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 256, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_fast_paths_compute_x_times_w_transposed(rows, bias, few_rows_by_mkl, monkeypatch):
    """Both 1-2 row paths (MKL's, or the packed copy as on an AVX-512 CPU), whatever this CPU is."""
    monkeypatch.setattr(cpu_linear, "FEW_ROWS_BY_MKL", few_rows_by_mkl)
    torch.manual_seed(rows)
    layer = cpu_linear.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    expected = lambda: x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    with torch.inference_mode():   # the fast paths: W @ x.T or the packed copy
        out = layer(x)
    assert out.shape == (rows, 80) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():          # the weight changes in place: the packed copy follows
        layer.weight.mul_(-2)
        torch.testing.assert_close(layer(x).double(), expected(), rtol=1e-5, atol=1e-5)
    out = layer(x)                 # with a gradient: plain F.linear (train_eagle trains through it)
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad.double(), torch.ones(rows, 80).double().T @ x.double(),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_linear.NATIVE_BF16, reason="bfloat16 takes the packed copy only on a CPU with "
                    "AVX-512 BF16 (elsewhere F.linear, torch's own)")
@pytest.mark.parametrize("rows", [1, 2, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_packed_bfloat16_computes_x_times_w_transposed(rows, bias):
    """bfloat16 through the packed copy (it is made: the fast path ran) gives the float64 product of
    its bfloat16 inputs within bfloat16's rounding, as torch's F.linear does."""
    torch.manual_seed(rows)
    layer = cpu_linear.Linear(48, 80, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, 48, dtype=torch.bfloat16)
    expected = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    with torch.inference_mode():
        out = layer(x)
        reference = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.dtype == torch.bfloat16 and hasattr(layer, "_packed")
    for y in (out, reference):
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)


def test_linear_bfloat16_takes_torchs_f_linear_without_native_bfloat16(monkeypatch):
    """Where the CPU has no AVX-512 BF16 (FAST_DTYPES without bfloat16), bfloat16 goes through F.linear
    as it is: no packed copy is made, and the output is F.linear's to the bit."""
    monkeypatch.setattr(cpu_linear, "FAST_DTYPES", (torch.float32,))
    layer = cpu_linear.Linear(48, 80, dtype=torch.bfloat16)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert not hasattr(layer, "_packed")


@pytest.mark.parametrize("name, params", [("llama3-8b", 8.030e9), ("llama3.2-1b", 1.236e9),
                                          ("qwen3-8b", 8.191e9), ("qwen3-1.7b", 1.721e9),
                                          ("qwen3-0.6b", 0.596e9)])
def test_random_models_have_the_real_models_shapes(name, params):
    """random:NAME builds the public config's shapes (counted on the meta device: no 8B allocation);
    the parameter counts are the published ones (Llama-3.1-8B 8.03B, Llama-3.2-1B 1.24B, Qwen3-8B
    8.19B, Qwen3-1.7B 1.7B, Qwen3-0.6B 0.6B, tied embeddings counted once)."""
    from nanospec.model import CausalLM
    config = checkpoint.read_checkpoint(f"random:{name}").config
    with torch.device("meta"):
        model = CausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(params, rel=1e-3)
    assert config.num_kv_heads == 8 and config.family == ("llama" if name.startswith("llama") else "qwen3")


def test_a_random_model_generates_over_its_whole_vocabulary():
    from nanospec import LLM, SamplingParams
    llm = LLM("random:tiny", device="cpu", dtype="float32", kv_cache_gb=0.01)
    out = llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=0, max_tokens=32, ignore_eos=True))[0]
    assert llm.vocab_size == 320 and max(out.token_ids) >= 257   # ids past the byte tokenizer's decode to ""
    with pytest.raises(NanospecError, match="no random model 'llama9'"):
        checkpoint.read_checkpoint("random:llama9")
