"""Every public EAGLE head layout loads and drafts what its own reference computes.

Each layout is built here with random weights, as its producer writes it (config fields, file
format, tensor names), for an 8-layer target (so EAGLE-3's three layers are distinct). The oracle
is a plain-PyTorch forward in float64 written from the layout's formulas (fc input order, which
target layers, which norms, d2t as target = draft + d2t[draft]), on the target's hidden states
from transformers: hidden_states[k] is the state entering layer k, [L] the final normed one.
nanospec's head modules must give the same logits, and the engine's first two drafts must be the
reference's argmaxes (the second step checks what is fed back)."""
import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nanospec import LLM, NanospecError
from nanospec.eagle import aux_layers
from nanospec.kv_cache import KVCache, build_metadata
from conftest import PROMPTS, greedy, write_checkpoint
from test_proposer import record_proposals

L = 8                       # target layers
DEFAULT = (2, L // 2, L - 3)  # the states entering these: where the EAGLE authors capture


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle_target") / "t"
    return write_checkpoint(str(folder), "llama3", seed=11, num_layers=L)


@pytest.fixture(scope="module")
def hf_target(target):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()


# layout -> (EAGLE version, what its producer writes)
LAYOUTS = {
    # SafeAILab EAGLE-1 for LLaMA-3: pytorch_model.bin, "bias": false, the frozen embedding saved
    "eagle1-llama3": dict(version=1, fmt="bin", fc_bias=False, embed="target", cfg={"bias": False}),
    # EAGLE-1 for Vicuna: no "bias" key (default true), fc with a bias
    "eagle1-vicuna": dict(version=1, fmt="bin", fc_bias=True, embed="target", cfg={}),
    # EAGLE-1 for Qwen2: q/k/v biases ("qkv_bias") and an fc bias
    "eagle1-qwen2": dict(version=1, fmt="bin", fc_bias=True, qkv_bias=True, cfg={"qkv_bias": True}),
    # as SGLang names it
    "eagle1-sglang": dict(version=1, fmt="safetensors", fc_bias=True, arch="LlamaForCausalLMEagle", cfg={}),
    # SafeAILab EAGLE-3: reduced vocabulary with d2t / t2d, no layer ids, no rope_theta
    "eagle3": dict(version=3, fmt="bin", draft_vocab=200, cfg={}, no_rope=True),
    # SpecForge: model.safetensors, its own head_dim, ids in eagle_config as the outputs of layers
    "eagle3-specforge": dict(version=3, fmt="safetensors", draft_vocab=200, head_dim=24,
                             arch="LlamaForCausalLMEagle3",
                             cfg={"eagle_config":
                                  {"eagle_aux_hidden_state_layer_ids": [1, L // 2 - 1, L - 4]}}),
    # vLLM's field: top-level ids, the states entering those layers
    "eagle3-vllm-ids": dict(version=3, fmt="safetensors", draft_vocab=200, layers=(1, 3, 6),
                            cfg={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}),
    # the full vocabulary: the EAGLE authors delete d2t and t2d
    "eagle3-full-vocab": dict(version=3, fmt="bin", draft_vocab=None, cfg={}),
    # AngelSlim: its architecture name, its own (here: not the target's) embedding, its own ids field
    "eagle3-angelslim": dict(version=3, fmt="safetensors", draft_vocab=200, embed="own",
                             arch="Eagle3LlamaForCausalLM", layers=(2, 5, 6),
                             cfg={"aux_hidden_states_layer_ids": [1, 4, 5]}),
    # variants (vLLM 0.32's llama_eagle3.py flags; fc_norm is SpecForge's EAGLE-3.1)
    "eagle3-fc-norm": dict(version=3, fmt="safetensors", draft_vocab=200, cfg={"fc_norm": True}),
    "eagle3-norm-before-fc": dict(version=3, fmt="safetensors", draft_vocab=200,
                                  cfg={"norm_before_fc": True}),
    "eagle3-norm-before-residual": dict(version=3, fmt="safetensors", draft_vocab=200,
                                        cfg={"norm_before_residual": True}),
    "eagle3-norm-output": dict(version=3, fmt="safetensors", draft_vocab=200, cfg={"norm_output": True}),
}


def build_layout(folder: str, target: str, name: str, seed: int = 0) -> dict:
    """Write the layout's config.json and weights; returns its tensors (float64) and config."""
    spec = LAYOUTS[name]
    tcfg = json.load(open(os.path.join(target, "config.json")))
    d = spec.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"]
    w = layout_weights(spec, tcfg, d, target, seed)
    cfg = layout_config(spec, tcfg, d)
    files = write_layout(folder, spec["fmt"], w, cfg)
    tensors = {k: (v.double() if v.is_floating_point() else v) for k, v in files.items()}
    return {"w": tensors, "cfg": cfg, "d": d}


def layout_weights(spec: dict, tcfg: dict, d: int, target: str, seed: int) -> dict:
    """The head's random tensors (float64), under the names the layout gives them."""
    h, inter, vocab = tcfg["hidden_size"], tcfg["intermediate_size"], tcfg["vocab_size"]
    heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64) / shape[-1] ** 0.5 * 1.5
    norm = lambda n=h: 1 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    v3 = spec["version"] == 3
    p = "midlayer" if v3 else "layers.0"
    attn_in = 2 * h if v3 else h
    w = {f"{p}.self_attn.q_proj.weight": rand(heads * d, attn_in),
         f"{p}.self_attn.k_proj.weight": rand(kv * d, attn_in),
         f"{p}.self_attn.v_proj.weight": rand(kv * d, attn_in),
         f"{p}.self_attn.o_proj.weight": rand(h, heads * d),
         f"{p}.mlp.gate_proj.weight": rand(inter, h), f"{p}.mlp.up_proj.weight": rand(inter, h),
         f"{p}.mlp.down_proj.weight": rand(h, inter), f"{p}.post_attention_layernorm.weight": norm()}
    if spec.get("qkv_bias"):
        w.update({f"{p}.self_attn.{x}_proj.bias": 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
                  for x, n in (("q", heads * d), ("k", kv * d), ("v", kv * d))})
    if not v3:
        w["fc.weight"] = rand(h, 2 * h)
        if spec["fc_bias"]:
            w["fc.bias"] = 0.1 * torch.randn(h, generator=g, dtype=torch.float64)
    else:
        dv = spec["draft_vocab"] or vocab
        w.update({"fc.weight": rand(h, 3 * h), f"{p}.hidden_norm.weight": norm(),
                  f"{p}.input_layernorm.weight": norm(), "norm.weight": norm(),
                  "lm_head.weight": rand(dv, h)})
        if spec["draft_vocab"]:
            kept = torch.randperm(vocab, generator=g)[:dv].sort().values
            w["d2t"] = kept - torch.arange(dv)
            w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)
        if spec["cfg"].get("fc_norm"):
            w.update({f"fc_norm.{i}.weight": norm() for i in range(3)})
        if spec["cfg"].get("norm_before_fc"):
            w["input_norm.weight"] = norm(3 * h)
    if spec.get("embed") == "target":
        w["embed_tokens.weight"] = load_target_embedding(target)
    elif spec.get("embed") == "own":
        w["embed_tokens.weight"] = rand(vocab, h)
    return w


def layout_config(spec: dict, tcfg: dict, d: int) -> dict:
    """The head's config.json: a one-layer Llama of the target's shapes, with the layout's fields."""
    cfg = {"architectures": [spec.get("arch", "LlamaForCausalLM")], "model_type": "llama",
           "hidden_size": tcfg["hidden_size"], "intermediate_size": tcfg["intermediate_size"],
           "num_attention_heads": tcfg["num_attention_heads"],
           "num_key_value_heads": tcfg["num_key_value_heads"], "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "vocab_size": tcfg["vocab_size"], "hidden_act": "silu",
           "max_position_embeddings": 2048,
           **({} if spec.get("no_rope") else {"rope_theta": target_theta(tcfg)}),
           **({"head_dim": d} if "head_dim" in spec else {}), **spec["cfg"]}
    if spec["version"] == 3:
        cfg["draft_vocab_size"] = spec["draft_vocab"] or tcfg["vocab_size"]
    return cfg


def write_layout(folder: str, fmt: str, w: dict, cfg: dict) -> dict:
    """Save the tensors (in float32) as `fmt` ("bin" or "safetensors") and config.json; returns them."""
    os.makedirs(folder, exist_ok=True)
    files = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in w.items()}
    if fmt == "bin":
        torch.save(files, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(files, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return files


def target_theta(tcfg: dict) -> float:
    return tcfg.get("rope_theta") or (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def load_target_embedding(target: str) -> torch.Tensor:
    from safetensors.torch import load_file
    return load_file(os.path.join(target, "model.safetensors"))["model.embed_tokens.weight"].double()


# ---- the reference: plain PyTorch, float64, from the layouts' formulas ----

def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta, d):   # x [T, heads, d]: Llama's rotate-half convention
    freqs = pos[:, None].double() / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def attention(x, w, p, cfg, d, pos):
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    proj = lambda n: x @ w[f"{p}.self_attn.{n}_proj.weight"].T + w.get(f"{p}.self_attn.{n}_proj.bias", 0)
    theta = cfg.get("rope_theta", 10000.0)
    q = rope(proj("q").view(len(x), heads, d), pos, theta, d)
    k = rope(proj("k").view(len(x), kv, d), pos, theta, d).repeat_interleave(heads // kv, 1)
    v = proj("v").view(len(x), kv, d).repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x), dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), heads * d)
    return out @ w[f"{p}.self_attn.o_proj.weight"].T


def mlp(x, w, p):
    gate, up = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T


def reference_drafts(layout: dict, spec: dict, hf, tokens: list[int], layers, k: int = 2):
    """The first step's logits over the target's vocabulary, and k greedy drafts, each step's
    output fed back as the layout's reference feeds it (the whole sequence rerun each step)."""
    w, cfg, d = layout["w"], layout["cfg"], layout["d"]
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight.detach())
    if spec["version"] == 1:
        feats = states[-1][0]                                          # after the target's final norm
    else:
        feats = fc3(w, cfg, torch.cat([states[i][0] for i in sorted(layers)], -1))   # layers in order
    ids, first, drafts = list(tokens[1:]), None, []                  # element i: (f_i, t_{i+1})
    for _ in range(k):
        x = layer_forward(w, cfg, d, spec, embed[torch.tensor(ids)], feats, torch.arange(len(ids)))[-1:]
        if spec["version"] == 1:
            logits, carried = x @ hf.lm_head.weight.detach().T, x      # the target's LM head, no norm
        else:
            draft_logits = rms(x, w["norm.weight"]) @ w["lm_head.weight"].T
            dv = draft_logits.shape[-1]
            target_ids = torch.arange(dv) + w.get("d2t", torch.zeros(dv, dtype=torch.int64))
            logits = torch.full((1, len(embed)), float("-inf"), dtype=torch.float64)
            logits[:, target_ids] = draft_logits
            carried = rms(x, w["norm.weight"]) if cfg.get("norm_output") else x
        first = logits if first is None else first
        drafts.append(int(logits.argmax()))
        feats, ids = torch.cat([feats, carried]), ids + [drafts[-1]]
    return first, drafts


def fc3(w, cfg, g):
    """EAGLE-3's first step: the three layers' states [T, 3H] -> the feature [T, H]."""
    if cfg.get("norm_before_fc"):
        g = rms(g, w["input_norm.weight"])
    if cfg.get("fc_norm"):
        g = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(g.chunk(3, -1))], -1)
    return g @ w["fc.weight"].T


def layer_forward(w, cfg, d, spec, e, h, pos):
    """The head's layer over elements (h_i, e_i) -> its outputs [T, H]."""
    if spec["version"] == 1:
        p = "layers.0"
        x = torch.cat([e, h], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)   # embedding first; no input norm
        x = x + attention(x, w, p, cfg, d, pos)
        return x + mlp(rms(x, w[f"{p}.post_attention_layernorm.weight"]), w, p)
    p = "midlayer"
    normed = rms(h, w[f"{p}.hidden_norm.weight"])
    a = torch.cat([rms(e, w[f"{p}.input_layernorm.weight"]), normed], -1)   # embedding first
    x = (normed if cfg.get("norm_before_residual") else h) + attention(a, w, p, cfg, d, pos)
    return x + mlp(rms(x, w[f"{p}.post_attention_layernorm.weight"]), w, p)


def expected_layers(spec) -> tuple:
    return tuple(sorted(spec.get("layers", DEFAULT))) if spec["version"] == 3 else ()


def nanospec_first_logits(llm, tokens: list[int]) -> torch.Tensor:
    """nanospec's head modules over the same elements (features from nanospec's own target)."""
    proposer, target = llm.engine.proposer, llm.model
    n = len(tokens) - 1
    with torch.no_grad():
        cache = KVCache(target.config.num_layers, n // 16 + 1, 16, target.config.num_kv_heads,
                        target.config.head_dim, torch.float32, "cpu")
        table = []
        cache.allocator.grow(table, n)   # (ids past the null and sink blocks, which no table holds)
        meta = build_metadata([table], [0], [n], 16, torch.device("cpu"))
        hidden, captured = target(torch.tensor(tokens[:-1]), torch.arange(n),
                                  cache, meta, proposer.capture_layers)
        head = proposer.head
        hcache = KVCache(1, n // 16 + 1, 16, head.config.num_kv_heads, head.config.head_dim,
                         torch.float32, "cpu")
        x = head(proposer.embed(torch.tensor(tokens[1:])), proposer.features(hidden, captured),
                 torch.arange(n), hcache, meta)[-1:]
        return head.logits(x, target)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_public_layout_loads_and_drafts_its_reference(target, hf_target, tmp_path, name):
    spec = LAYOUTS[name]
    layers = expected_layers(spec)
    layout = build_layout(str(tmp_path / name), target, name, seed=len(name))
    warns = {"eagle3": "no rope_theta", "eagle3-norm-output": "norm_output", "eagle3-angelslim": "AngelSlim"}
    with pytest.warns(UserWarning, match=warns[name]) if name in warns else contextlib.nullcontext():
        llm = LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, eagle=str(tmp_path / name),
                  num_speculative_tokens=2)
    assert llm.engine.proposer.capture_layers == layers
    calls = record_proposals(llm)
    llm.generate(PROMPTS[:3], greedy(4))
    checked = 0
    for tokens, drafts in calls:   # every round checked from scratch, with the same head state
        ref_logits, ref_drafts = reference_drafts(layout, spec, hf_target, tokens, layers, len(drafts))
        ours = nanospec_first_logits(llm, tokens)
        finite = torch.isfinite(ref_logits)
        assert torch.equal(finite, torch.isfinite(ours))          # the draft vocabulary, mapped by d2t
        torch.testing.assert_close(ours[finite].double(), ref_logits[finite], atol=2e-4, rtol=2e-4)
        assert drafts == ref_drafts, (name, tokens)
        checked += 1
    assert checked >= 6   # later rounds too: the first round's second drafts happen to repeat the first


def test_a_head_given_as_a_hub_id_loads_from_the_local_cache(target, tmp_path, monkeypatch):
    """--eagle owner/name: huggingface_hub's cache with HF_HUB_OFFLINE=1, pytorch_model.bin included."""
    rev = "b" * 40
    build_layout(str(tmp_path / "models--org--head" / "snapshots" / rev), target, "eagle1-llama3")
    (tmp_path / "models--org--head" / "refs").mkdir()
    (tmp_path / "models--org--head" / "refs" / "main").write_text(rev)
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path))
    llm = LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, eagle="org/head",
              num_speculative_tokens=2)
    assert llm.engine.proposer.head.version == 1
    with pytest.raises(NanospecError, match="could not get 'org/other'"):
        LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, eagle="org/other")


@pytest.mark.parametrize("cfg, layers", [
    # the EAGLE authors' capture
    ({}, DEFAULT),
    # vLLM's: the states entering the layers
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, (2, 4, 5)),
    # SGLang's: the outputs of the layers before
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, (2, 4, 5)),
    # AngelSlim's: outputs
    ({"aux_hidden_states_layer_ids": [1, 3, 4]}, (2, 4, 5)),
    # both, agreeing
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, (2, 4, 5)),
    # an older nanospec head
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
      "trained_target_dtype": "float32"}, (2, 4, 5)),
    # concatenated in layer order
    ({"eagle_aux_hidden_state_layer_ids": [5, 2, 4]}, (2, 4, 5)),
])
def test_layer_ids_are_read_as_their_writers_mean_them(cfg, layers):
    assert aux_layers(cfg, L, "config.json") == layers


def test_layer_ids_that_disagree_get_a_warning_that_names_the_fix():
    cfg = {"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}
    with pytest.warns(UserWarning, match="disagree.*delete the top-level field"):
        assert aux_layers(cfg, L, "config.json") == (2, 4, 5)
    with pytest.raises(NanospecError, match="three layer numbers"):
        aux_layers({"eagle_aux_hidden_state_layer_ids": [2, 4]}, L, "config.json")
    with pytest.raises(NanospecError, match="not layers of the 8-layer target"):
        aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}}, L, "config.json")


@pytest.mark.parametrize("mutate, match", [
    (lambda cfg, w: cfg.update(fc_norm=True), "fc_norm is an EAGLE-3 variant, but this is an EAGLE-1 head"),
    (lambda cfg, w: cfg.update(norm_output="yes"), "norm_output must be true or false"),
    (lambda cfg, w: w.pop("d2t"), "drafts over 200 tokens, not the target's 320, but has no d2t"),
])
def test_variants_and_vocabularies_that_cannot_be_run_are_refused_in_one_line(target, tmp_path,
                                                                              mutate, match):
    name = "eagle1-sglang" if "EAGLE-1" in match else "eagle3-specforge"
    layout = build_layout(str(tmp_path / "h"), target, name)
    cfg, w = layout["cfg"], {k: (v.float() if v.is_floating_point() else v) for k, v in layout["w"].items()}
    mutate(cfg, w)
    save_file(w, str(tmp_path / "h" / "model.safetensors"))
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NanospecError, match=match):
        LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, eagle=str(tmp_path / "h"))


def test_a_token_map_drafts_among_its_ids_with_the_target_heads_rows(spec_models, tmp_path):
    """SGLang's --speculative-token-map (FR-Spec): the head's logits are the target LM head's at the
    map's ids (the oracle: the whole head, in float64) and -inf at every other id."""
    torch.save([7, 3, 250, 3, 41], str(tmp_path / "map.pt"))   # unsorted, one id twice: as given
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              eagle=spec_models["eagle1"], speculative_token_map=str(tmp_path / "map.pt"))
    head, target = llm.draft_models.head, llm.model
    hidden = torch.randn(5, target.config.hidden_size)
    expected = torch.full((5, target.config.vocab_size), float("-inf"), dtype=torch.float64)
    ids = [3, 7, 41, 250]
    expected[:, ids] = (hidden.double() @ target.lm_head.weight.double().T)[:, ids]
    torch.testing.assert_close(head.logits(hidden, target).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("content, with_head, match", [
    ([1, 2, 3], "eagle3", "EAGLE-3 head in .* drafts over its own vocabulary .*: a token map is for EAGLE-1"),
    ([1, 2, 3], None, "speculative_token_map is the vocabulary an EAGLE-1 head drafts among: add eagle"),
    ([1, 2, 10**6], "eagle1", r"ids outside the target's vocabulary \[0, 320\): it was made for another"),
    ([], "eagle1", "not a non-empty list of token ids"),
    ([[1, 2], [3, 4]], "eagle1", "shape \\[2, 2\\], not a non-empty list of token ids"),
    ([0.5, 1.5], "eagle1", "torch.float32 tensor .* not a non-empty list of token ids"),
    (b"not a torch file", "eagle1", "is not a torch.save'd list or tensor of token ids .*torch.save"),
    (None, "eagle1", "token map '/no/such/map.pt' not found: give a file of token ids or a hub path"),
])
def test_a_token_map_that_cannot_be_used_is_refused_in_one_line(spec_models, tmp_path, content, with_head,
                                                                match):
    path = Path("/no/such/map.pt") if content is None else str(tmp_path / "map.pt")   # (a Path too)
    if isinstance(content, bytes):
        (tmp_path / "map.pt").write_bytes(content)
    elif content is not None:
        torch.save(content if content else torch.tensor([], dtype=torch.int64), path)
    head = dict(eagle=spec_models[with_head]) if with_head else dict(ngram=True)
    with pytest.raises(NanospecError, match=match):
        LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
            speculative_token_map=path, **head)
