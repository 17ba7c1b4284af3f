"""train_eagle.py: the training forward is the head's inference forward (training-time test
included), a tiny run lowers its loss, writes a head that loads and decodes losslessly, and a
stopped run resumes to the same head."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

import train_eagle
from nanospec import LLM, NanospecError, SamplingParams
from nanospec.kv_cache import KVCache, build_metadata

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello there, how", "1 2 3 4"]


def paged_head(head, embeds, features, positions_from, cache, table):
    """The head's own (inference) forward over consecutive elements, appending to its paged cache."""
    n = len(embeds)
    cache.allocator.grow(table, positions_from + n)
    meta = build_metadata([table], [positions_from], [n], cache.block_size, embeds.device)
    return head(embeds, features, meta.positions, cache, meta)


def random_head(spec_models, arch):
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.01)
    aux = train_eagle.default_aux_layers(llm.config.num_layers) if arch == "eagle3" else ()
    cfg = train_eagle.head_config(llm.config, arch, 50, aux)
    torch.manual_seed(0)
    head = train_eagle.new_head(llm.config, cfg, 50)
    for p in head.parameters():   # not the near-identity init: every path must matter
        torch.nn.init.normal_(p, std=0.2)
    return llm, head


def test_eagle1_training_forward_equals_inference_forward(spec_models):
    llm, head = random_head(spec_models, "eagle1")
    h, n = llm.config.hidden_size, 11
    embeds, features = torch.randn(n, h), torch.randn(n, h)
    dense = train_eagle.eagle1_forward(head, embeds[None], features[None], torch.arange(n), [])[0]
    cache = KVCache(1, 8, 4, head.config.num_kv_heads, head.config.head_dim,
                    torch.float32, torch.device("cpu"))
    paged = paged_head(head, embeds, features, 0, cache, [])
    torch.testing.assert_close(dense, paged, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_training_time_test_sees_what_drafting_sees(spec_models, arch):
    """Step j's output at element i equals drafting: the head prefilled with real elements 0 .. i-j,
    then fed its own output j times (with the data's tokens), one element at a time."""
    llm, head = random_head(spec_models, arch)
    h, n, steps = llm.config.hidden_size, 9, 3
    embeds, features = torch.randn(n, h), torch.randn(n, (3 if arch == "eagle3" else 1) * h)
    forward = train_eagle.eagle3_forward if arch == "eagle3" else train_eagle.eagle1_forward
    past, feats, dense = [], features[None], []
    for j in range(steps):
        out = forward(head, embeds[None], feats, torch.arange(n), past)
        dense.append(out[0])
        feats = train_eagle.next_input_features(out)
    for j in range(steps):
        for i in range(j, n):
            cache = KVCache(1, 8, 4, head.config.num_kv_heads, head.config.head_dim,
                            torch.float32, torch.device("cpu"))
            table, real = [], i - j
            out = paged_head(head, embeds[:real + 1], features[:real + 1], 0, cache, table)[-1:]
            for step in range(1, j + 1):
                out = paged_head(head, embeds[real + step:real + step + 1], out, real + step, cache, table)
            scale = float(dense[j].detach().abs().max())   # float32 rounding grows with the values fed back
            torch.testing.assert_close(dense[j][i], out[0], atol=1e-4 + 1e-6 * scale, rtol=1e-4,
                                       msg=lambda m: f"step {j}, element {i}: {m}")


def tiny_args(target, out, arch, steps=40, **extra):
    args = ["--target", target, "--out", str(out), "--arch", arch, "--num-prompts", "8",
            "--response-tokens", "24", "--seq-len", "112", "--batch-size", "4", "--steps", str(steps),
            "--warmup", "4", "--lr", "3e-3", "--draft-vocab", "64", "--save-every", "5", "--no-eval",
            "--device", "cpu", "--dtype", "float32"]
    return args + [x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_tiny_run_lowers_loss_and_writes_a_lossless_head(spec_models, tmp_path, arch):
    out = tmp_path / arch
    assert train_eagle.main(tiny_args(spec_models["target"], out, arch, steps=100)) == 0
    history = json.loads((out / "train_report.json").read_text())["training"]["history"]
    first, last = [sum(h["loss"] for h in part) / 5 for part in (history[:5], history[-5:])]
    assert last < 0.8 * first, (first, last)
    weights = load_file(str(out / "model.safetensors"))   # the public layout: q/k/v and gate/up apart
    prefix = "layers.0" if arch == "eagle1" else "midlayer"
    assert f"{prefix}.self_attn.q_proj.weight" in weights and f"{prefix}.mlp.gate_proj.weight" in weights
    assert "embed_tokens.weight" not in weights and ("d2t" in weights) == (arch == "eagle3")
    # EAGLE-1's loss vocabulary, as a token map: 64 ids, each once, sorted
    assert (out / "token_map.pt").exists() == (arch == "eagle1")
    if arch == "eagle1":
        ids = torch.load(str(out / "token_map.pt"), weights_only=True)
        assert len(ids) == 64 and torch.equal(ids, torch.unique(ids))
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    spec = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, eagle=str(out),
               num_speculative_tokens=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == \
           [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert spec.stats["drafted_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_a_head_that_learned_its_data_is_accepted_by_the_engine(spec_models, tmp_path, arch, dtype):
    """End to end, training and serving see the same thing: a head trained until it agrees with
    the target on its own (few) sequences drafts those same answers in the real engine, so nearly
    every draft is accepted. A feature taken one position off, another norm, another mask or
    another chain in the training-time test would show here as a low acceptance length; so would
    a target that trains in one dtype and serves in another. Both dtypes pinned: the verdict must
    not depend on the machine."""
    if dtype == "bfloat16" and not train_eagle.native_bfloat16():
        pytest.skip("this CPU has no native bfloat16 (AVX-512 BF16 or AMX), or NANOSPEC_NATIVE_BF16=0")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / arch
    args = tiny_args(spec_models["target"], out, arch, steps=150, data=str(data), num_prompts=len(PROMPTS),
                     lr=1e-2, feature_noise=0, dtype=dtype)
    assert train_eagle.main(args) == 0
    history = json.loads((out / "train_report.json").read_text())["training"]["history"]
    assert min(history[-1]["acc0"], history[-1]["acc1"]) > 0.95, history[-1]
    spec = LLM(spec_models["target"], device="cpu", dtype=dtype, kv_cache_gb=0.05, eagle=str(out),
               num_speculative_tokens=3)
    spec.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), chat=True)   # as the data were made
    assert spec.stats["mean_acceptance_length"] > 3.3, spec.stats   # of at most 4
    if arch == "eagle1":   # drafting among the token map it wrote (its answers' ids) loses nothing here
        mapped = LLM(spec_models["target"], device="cpu", dtype=dtype, kv_cache_gb=0.05, eagle=str(out),
                     num_speculative_tokens=3, speculative_token_map=str(out / "token_map.pt"))
        mapped.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), chat=True)
        assert mapped.stats["mean_acceptance_length"] > 3.3, mapped.stats


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_same_head(spec_models, tmp_path, monkeypatch):
    target = spec_models["target"]
    assert train_eagle.main(tiny_args(target, tmp_path / "straight", "eagle1", steps=10)) == 0

    real_progress = train_eagle.progress

    def stop_after_7(step, *rest):
        real_progress(step, *rest)
        if step == 7:
            raise KeyboardInterrupt   # the last checkpoint is step 5's
    monkeypatch.setattr(train_eagle, "progress", stop_after_7)
    # the interrupted run exits with Ctrl-C's status
    assert train_eagle.main(tiny_args(target, tmp_path / "stopped", "eagle1", steps=10)) == 130
    monkeypatch.setattr(train_eagle, "progress", real_progress)
    assert train_eagle.main(tiny_args(target, tmp_path / "stopped", "eagle1", steps=10)) == 0
    straight, resumed = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("straight", "stopped"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(straight[name], resumed[name], atol=1e-6, rtol=1e-6, msg=name)
    report = json.loads((tmp_path / "stopped" / "train_report.json").read_text())
    assert report["training"]["steps"] == 10 and len(report["training"]["history"]) == 10


@pytest.mark.slow
def test_resuming_with_other_settings_is_refused(spec_models, tmp_path, capsys):
    assert train_eagle.main(tiny_args(spec_models["target"], tmp_path, "eagle1", steps=5)) == 0
    assert train_eagle.main(tiny_args(spec_models["target"], tmp_path, "eagle1", steps=5, lr=1e-2)) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.slow
def test_prompts_that_fill_the_sequence_length_are_left_out_or_refused(spec_models, tmp_path, capsys):
    target = spec_models["target"]
    assert train_eagle.main(tiny_args(target, tmp_path / "some", "eagle1", steps=5, seq_len=60)) == 0
    assert "left out: their prompt fills --seq-len" in capsys.readouterr().out
    assert train_eagle.main(tiny_args(target, tmp_path / "none", "eagle1", steps=5, seq_len=8)) == 2
    assert "raise it" in capsys.readouterr().err


def test_the_head_records_its_dtype_and_the_engine_warns_in_another(spec_models, tmp_path):
    """Training's data, features and evaluation share one dtype, written into the head's config and
    the report; serving the head beside a target in another dtype warns, naming both."""
    out = tmp_path / "head"
    assert train_eagle.main(tiny_args(spec_models["target"], out, "eagle1", steps=5)) == 0
    assert json.loads((out / "config.json").read_text())["trained_target_dtype"] == "float32"
    assert json.loads((out / "train_report.json").read_text())["dtype"] == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same dtype: no warning
        LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.01, eagle=str(out))
    with pytest.warns(UserWarning, match="float32 features but the target runs in bfloat16"):
        LLM(spec_models["target"], device="cpu", dtype="bfloat16", kv_cache_gb=0.01, eagle=str(out))


@pytest.mark.parametrize("flag,value,match", [
    ("lr", "nan", "--lr must be a finite number > 0"), ("lr", "-1", "--lr must be"),
    ("grad_clip", "0", "--grad-clip must be"), ("weight_decay", "-0.1", "--weight-decay must be"),
    ("eval_k", "0", "--eval-k must be an integer in 1..16"), ("steps", "0", "--steps must be >= 1"),
])
def test_bad_training_flags_are_one_line(tmp_path, capsys, flag, value, match):
    assert train_eagle.main(tiny_args("unused", tmp_path / "out", "eagle1", **{flag: value})) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    out = tmp_path / "a_file"
    out.write_text("")
    assert train_eagle.main(tiny_args("unused", out, "eagle1")) == 2   # (it was os.makedirs' traceback)
    err = capsys.readouterr().err
    assert "is a file: give a folder" in err and len(err.strip().splitlines()) == 1, err


def test_a_planted_training_checkpoint_runs_no_code(tmp_path):
    """OUT/checkpoint.pt is read with weights_only: a pickle that would run code is refused, unrun."""
    from conftest import Planted
    path = tmp_path / "checkpoint.pt"
    torch.save({"head": {}, "x": Planted(str(tmp_path / "RAN"))}, path)
    with pytest.raises(NanospecError, match="not a training checkpoint"):
        train_eagle.load_training_checkpoint(str(path))
    assert not (tmp_path / "RAN").exists()


# What vLLM and SGLang require of a head's files, written down from their loaders' code: vLLM 0.32
# (the CPU wheel that runs here; paths under vllm/) and SGLang (paths under python/sglang/srt/).
# vllm/transformers_utils/configs/eagle.py EAGLEConfig: method "eagle" prefixes "Eagle" unless the
# name starts with it, "eagle3" prefixes "Eagle3" unless it starts or ends with it; the result must
# be in vllm/model_executor/models/registry.py's _SPECULATIVE_DECODING_MODELS.
VLLM_CLASSES = {"EagleLlamaForCausalLM": 1, "Eagle3LlamaForCausalLM": 3, "LlamaForCausalLMEagle3": 3}


def vllm_class(arch: str, version: int) -> str:
    if version == 1:
        return arch if arch.startswith("Eagle") else f"Eagle{arch}"
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def vllm_accepts(cfg: dict, weights: dict, version: int, num_layers: int) -> list[str]:
    """The problems vLLM 0.32 would have with this head (empty: it loads and reads it as meant)."""
    problems = []
    if VLLM_CLASSES.get(vllm_class(cfg["architectures"][0], version)) != version:
        problems.append(f"architectures {cfg['architectures']} is no EAGLE-{version} class in vLLM")
    if version == 1:
        # models/llama_eagle.py: fc = ReplicatedLinear(2H -> H, bias=False); layer 0's input norm is
        # nn.Identity; no lm_head module (the target's); embed_tokens skipped at load yet marked as
        # the head's own (v1/spec_decode: kept apart unless equal to the target's)
        allowed = {"fc.weight"} | {k for k in weights
                                   if k.startswith("layers.0.") and "input_layernorm" not in k}
    else:
        # models/llama_eagle3.py: midlayer. -> layers.0.; fc bias=False; d2t -> draft_id_to_target_id;
        # t2d skipped; norm, lm_head; the fc's width from eagle_config's ids (3 when absent)
        allowed = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | \
                  {k for k in weights if k.startswith("midlayer.")}
        if cfg.get("draft_vocab_size") != weights["lm_head.weight"].shape[0]:
            problems.append("draft_vocab_size is not lm_head's rows")
        # v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config: the top-level ids first,
        # as the states entering those layers (models/llama.py); else eagle_config's, as they are
        ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("eagle_config", {}).get(
            "eagle_aux_hidden_state_layer_ids")
        if sorted(ids or ()) != sorted((2, num_layers // 2, num_layers - 3)):   # appended in layer order
            problems.append(f"vLLM reads the layers {ids}, not the ones the head was trained on")
    problems += [f"vLLM has no parameter for {k}" for k in weights if k not in allowed]
    if "embed_tokens.weight" in weights:
        problems.append("embed_tokens.weight: vLLM would keep it apart from the target's")
    return problems


def sglang_accepts(cfg: dict, weights: dict, version: int, num_layers: int) -> list[str]:
    """The problems SGLang would have with this head."""
    problems = []
    # models/registry.py: the class is the first name in architectures that is a class name
    want = "LlamaForCausalLMEagle" if version == 1 else "LlamaForCausalLMEagle3"
    if cfg["architectures"][0] != want:
        problems.append(f"architectures {cfg['architectures']}: SGLang's EAGLE-{version} class is {want}")
    if version == 1:
        # models/llama_eagle.py: fc = nn.Linear(2H, H) (a bias always: a missing one stays random);
        # every name gets "model."; lm_head skipped; layer 0's input norm deleted
        if "fc.bias" not in weights:
            problems.append("fc.bias missing: SGLang's EAGLE-1 fc has a bias")
        allowed = {"fc.weight", "fc.bias", "embed_tokens.weight"} | \
                  {k for k in weights if k.startswith("layers.0.") and "input_layernorm" not in k}
    else:
        # models/llama_eagle3.py: fc bias = config "bias" (none); d2t -> hot_token_id; t2d skipped;
        # config.draft_vocab_size read directly; model_executor/model_runner.py reads only
        # eagle_config's ids and llama.py set_eagle3_layers_to_capture adds 1 (the output of layer i)
        allowed = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | \
                  {k for k in weights if k.startswith("midlayer.")}
        if "draft_vocab_size" not in cfg:
            problems.append("no draft_vocab_size: SGLang reads it")
        ids = cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        captured = [i + 1 for i in ids] if ids else [2, num_layers // 2, num_layers - 3]
        if sorted(captured) != sorted((2, num_layers // 2, num_layers - 3)):
            problems.append(f"SGLang captures the states entering {captured}")
    problems += [f"SGLang has no parameter for {k}" for k in weights if k not in allowed]
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_what_train_eagle_writes_loads_unchanged_in_vllm_and_sglang(spec_models, tmp_path, arch):
    out = tmp_path / arch
    assert train_eagle.main(tiny_args(spec_models["target"], out, arch, steps=6)) == 0
    version, num_layers = int(arch[-1]), 4
    folders = {"vllm": out, "sglang": out / "sglang" if arch == "eagle1" else out}
    for engine, accepts in (("vllm", vllm_accepts), ("sglang", sglang_accepts)):
        cfg = json.loads((folders[engine] / "config.json").read_text())
        weights = load_file(str(folders[engine] / "model.safetensors"))
        assert accepts(cfg, weights, version, num_layers) == [], engine
        other = sglang_accepts if engine == "vllm" else vllm_accepts
        if arch == "eagle1":   # one file cannot serve both: the rules above must say so
            assert other(cfg, weights, version, num_layers) != []
    if arch == "eagle1":   # nanospec loads both, and they draft alike (SGLang's fc bias is zero)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = [LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
                    eagle=str(folders[e]), num_speculative_tokens=3) for e in ("vllm", "sglang")]
        assert [o.token_ids for o in outs[0].generate(PROMPTS, params)] == \
               [o.token_ids for o in outs[1].generate(PROMPTS, params)]
        assert [outs[i].stats["accepted_tokens"] for i in (0, 1)] == [outs[1].stats["accepted_tokens"]] * 2


def test_the_engine_rules_catch_the_old_layout():
    """The rules fail on what train_eagle.py wrote before: EAGLE-1 with fc.bias, the embedding and
    LlamaForCausalLM; EAGLE-3 with its layers only in eagle_config, in nanospec's own meaning."""
    w1 = {"fc.weight": torch.zeros(4, 8), "fc.bias": torch.zeros(4), "embed_tokens.weight": torch.zeros(9, 4),
          "layers.0.mlp.up_proj.weight": torch.zeros(8, 4)}
    assert vllm_accepts({"architectures": ["LlamaForCausalLM"]}, w1, 1, 4) != []
    assert sglang_accepts({"architectures": ["LlamaForCausalLM"]}, w1, 1, 4) != []
    w3 = {"fc.weight": torch.zeros(4, 12), "lm_head.weight": torch.zeros(5, 4), "norm.weight": torch.zeros(4),
          "d2t": torch.zeros(5, dtype=torch.int64)}
    old = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 5,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 2, 1]}}
    assert sglang_accepts(old, w3, 3, 4) != []
