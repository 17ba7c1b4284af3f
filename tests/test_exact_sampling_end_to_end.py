"""End to end at a real vocabulary size (151,936 ids, Qwen's), every proposer: top_k = 1 sampling is greedy
decoding token for token, and a request's tokens are a function of its own prompt, parameters and
seed: the same alone, inside batches that mix greedy, top-k, top-p, other temperatures and seeds,
and under preemption. Then the vocabulary and context edges: an embedding padded past the
tokenizer, a draft with a smaller embedding or a shorter context, EAGLE on a one-token prompt."""
import pytest
from safetensors.torch import load_file, save_file

from conftest import write_checkpoint, write_eagle_head
from nanospec import LLM, SamplingParams
from nanospec.errors import NanospecError
from conftest import PROMPTS, assert_no_leak

VOCAB = 151_936                 # Qwen 2.5 / 3
PROPOSERS = ["plain", "ngram", "draft", "eagle1", "eagle3", "suffix", "hybrid_eagle1"]
K = 3


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_vocab")
    target = write_checkpoint(str(root / "target"), "llama3", seed=11, num_layers=4, vocab_size=VOCAB)
    return {"target": target,
            "draft": write_checkpoint(str(root / "draft"), "llama3", seed=12, num_layers=1, vocab_size=VOCAB),
            "eagle1": write_eagle_head(str(root / "eagle1"), target, 1, seed=13),
            "eagle3": write_eagle_head(str(root / "eagle3"), target, 3, seed=14, draft_vocab=2000)}


def build(models, name: str, **kw) -> LLM:
    args = {"plain": {}, "ngram": dict(ngram=True), "draft": dict(draft=models["draft"]),
            "eagle1": dict(eagle=models["eagle1"]), "eagle3": dict(eagle=models["eagle3"]),
            "suffix": dict(suffix=True), "hybrid_eagle1": dict(suffix=True, eagle=models["eagle1"])}[name]
    if name != "plain":
        args["num_speculative_tokens"] = K
    return LLM(models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, **args, **kw)


@pytest.fixture(scope="module")
def greedy_reference(big_vocab):
    outs = build(big_vocab, "plain").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40,
                                                                      ignore_eos=True))
    return [o.token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name", PROPOSERS)
def test_top_k_1_sampling_is_greedy_decoding(big_vocab, greedy_reference, name):
    """8 requests x 40 tokens (the old sampler's noise drew a zero-probability token in 0.9% of
    draws at this vocabulary: about 3 of these 320)."""
    llm = build(big_vocab, name)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=s, max_tokens=40, ignore_eos=True)
              for s in range(8)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == greedy_reference
    assert name == "plain" or llm.stats["drafted_tokens"] > 0


# A probe request and its neighbours: greedy, top-k, top-p, other temperatures and seeds.
PROBE = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
NEIGHBOURS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.3, top_p=0.8, seed=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.6, top_k=40, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)]


@pytest.mark.slow
@pytest.mark.parametrize("name", [p for p in PROPOSERS if not p.startswith("hybrid")])
def test_a_requests_tokens_do_not_depend_on_its_batch(big_vocab, name):
    """Suffix decoding too, though its drafts come from other requests: one-hot drafts are coupled
    to plain sampling. (Not the hybrid: which drafts a request gets, the suffix's or the model's,
    follows every request's acceptance, and model drafts set which tokens come out, though not
    their distribution: test_speculative's chi-square tests.)"""
    llm = build(big_vocab, name)
    prompts, params = PROMPTS[:5], [PROBE] + NEIGHBOURS
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    # A pool too small for the batch: requests are preempted and recompute, and still agree.
    tight = build(big_vocab, name, num_kv_blocks=24, block_size=4)
    assert [o.token_ids for o in tight.generate(prompts, params)] == alone
    assert tight.stats["preemptions"] > 0
    assert_no_leak(tight)


@pytest.mark.parametrize("k", [1, 5])
def test_ngram_output_is_plain_sampling_output(spec_models, k):
    """One-hot drafts are accepted while they equal the target's own draw at that position, so
    with n-gram the output at any temperature is plain sampling's, token for token, whatever K.
    (The 320-token target: a random 32k-token model never repeats itself, so n-gram finds nothing
    to accept there; test_rejection checks the same at a 32k vocabulary without a model.)"""
    params = [SamplingParams(temperature=t, top_k=k_, top_p=p, seed=s, max_tokens=40, ignore_eos=True)
              for s, (t, k_, p) in enumerate([(0.1, 0, 1.0), (0.2, 0, 0.9), (0.15, 20, 1.0), (1.0, 0, 1.0),
                                              (0.1, 3, 0.5)])]
    plain = (LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
             .generate(PROMPTS[:5], params))
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, ngram=True,
              num_speculative_tokens=k)
    assert [o.token_ids for o in llm.generate(PROMPTS[:5], params)] == [o.token_ids for o in plain]
    assert 0 < llm.stats["accepted_tokens"] < llm.stats["drafted_tokens"]


# The vocabulary and context edges, on small checkpoints (a 320-token tokenizer).

@pytest.fixture(scope="module")
def edges(tmp_path_factory, checkpoints):
    root = tmp_path_factory.mktemp("edges")
    padded = write_checkpoint(str(root / "padded"), "llama3", seed=21, num_layers=2, model_vocab=320 + 128)
    weights = load_file(f"{padded}/model.safetensors")
    weights["lm_head.weight"][320:] *= 50     # padding ids would win every argmax if they could
    save_file(weights, f"{padded}/model.safetensors", metadata={"format": "pt"})
    return {"padded": padded,
            "draft_smaller": write_checkpoint(str(root / "d1"), "llama3", seed=22, num_layers=1,
                                              model_vocab=320 + 16),
            "draft_too_small": write_checkpoint(str(root / "d2"), "llama3", seed=23, num_layers=1,
                                                model_vocab=300),
            "draft_short": write_checkpoint(str(root / "d3"), "llama3", seed=24, num_layers=1,
                                            max_positions=40),
            "target": checkpoints["llama3"]}


def test_padding_ids_are_never_emitted_and_never_accepted(edges):
    llm = LLM(edges["padded"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True)):
        outs = llm.generate(PROMPTS[:3], params)
        assert all(t < 320 for o in outs for t in o.token_ids)
    with pytest.raises(NanospecError, match="token id 400"):
        llm.generate([5, 400], SamplingParams(max_tokens=2))
    assert llm.generate([5, 6], SamplingParams(temperature=0, max_tokens=2))[0].token_ids   # still usable


@pytest.mark.slow
def test_a_draft_with_a_smaller_padded_embedding_works(edges):
    """Target 448 ids, draft 336, tokenizer 320 (Qwen2.5-7B and -0.5B: 152,064 and 151,936)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = (LLM(edges["padded"], device="cpu", dtype="float32", kv_cache_gb=0.05)
             .generate(PROMPTS[:3], params))
    llm = LLM(edges["padded"], device="cpu", dtype="float32", kv_cache_gb=0.05, draft=edges["draft_smaller"])
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], params)] == [o.token_ids for o in plain]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    assert all(t < 320 for o in llm.generate(PROMPTS[:3], sampled) for t in o.token_ids)


def test_a_draft_that_cannot_embed_the_tokenizer_is_refused(edges):
    with pytest.raises(NanospecError, match="embeds 300 token ids"):
        LLM(edges["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, draft=edges["draft_too_small"])


def test_a_draft_with_a_shorter_context_drafts_until_it_ends(edges):
    """The draft's positions end at 40; requests run to 80 tokens: it drafts while it can, then
    the request goes on without drafts."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = (LLM(edges["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
             .generate(PROMPTS[:3], params))
    llm = LLM(edges["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, draft=edges["draft_short"],
              num_speculative_tokens=4)
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], params)] == [o.token_ids for o in plain]
    assert llm.stats["drafted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_eagle_on_a_one_token_prompt(spec_models, version):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              eagle=spec_models[version])
    assert llm.generate([7], params)[0].token_ids == plain.generate([7], params)[0].token_ids   # alone
    batch = [[7], PROMPTS[0], [9]]
    assert [o.token_ids for o in llm.generate(batch, params)] == [o.token_ids
                                                                  for o in plain.generate(batch, params)]
    assert llm.stats["drafted_tokens"] > 0
    assert_no_leak(llm)
