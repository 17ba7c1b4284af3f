"""Each proposer drafts what its definition says, from the state it keeps in step with the target:
n-gram lookup finds the longest recent match; the draft model's drafts are its own greedy
continuation; an EAGLE head's drafts equal the head run from scratch on the target's features."""
import pytest
import torch

from nanospec import LLM, NanospecError, SamplingParams
from nanospec.kv_cache import KVCache, build_metadata
from nanospec.proposer import NgramIndex
from conftest import PROMPTS, greedy


def test_ngram_prefers_the_longest_suffix_and_the_latest_occurrence():
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3]
    # suffix [1, 2, 3] occurred at the start, followed by 9 ...; [2, 3] later, followed by 7.
    assert index.lookup(tokens, 4) == [9, 2, 3, 7]
    assert index.lookup(tokens + [4], 3) == []                    # 4 never occurred before
    assert index.lookup(tokens + [4, 2, 3], 2) == [4, 2]          # longest match [2, 3]: the latest one wins
    assert NgramIndex(2, 3).lookup([5, 6, 5], 2) == []            # min_n = 2: a single token is not enough
    assert NgramIndex(1, 3).lookup([8, 8, 8], 5) == [8]           # proposes only what exists


def test_ngram_index_grows_incrementally():
    """Looking up after each appended token gives what a fresh index over the whole list gives."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    grown = NgramIndex(1, 4)
    for end in range(1, len(tokens)):
        assert grown.lookup(tokens[:end], 3) == NgramIndex(1, 4).lookup(tokens[:end], 3)


def record_proposals(llm):
    """Keep (tokens of each request, its drafts) for every draft round."""
    engine, calls, pending = llm.engine, [], []
    prepare, run_round = engine.proposer.prepare, engine.step_graphs.run_round

    def spy_prepare(requests, ks):
        pending[:] = [(list(r.tokens), k) for r, k in zip(requests, ks)]
        return prepare(requests, ks)

    def spy_round(plan):
        run_round(plan)
        drafts = engine.step_graphs.drafts
        calls.extend((tokens, drafts[b, :k].tolist()) for b, (tokens, k) in enumerate(pending) if k)
    engine.proposer.prepare, engine.step_graphs.run_round = spy_prepare, spy_round
    return calls


def test_draft_model_drafts_its_own_greedy_continuation(spec_models):
    llm = LLM(spec_models["target"], device="cpu", kv_cache_gb=0.05, draft=spec_models["draft"],
              num_speculative_tokens=5)
    calls = record_proposals(llm)
    llm.generate(PROMPTS, greedy())
    plain_draft = LLM(spec_models["draft"], device="cpu", kv_cache_gb=0.05)
    outs = plain_draft.generate([tokens for tokens, _ in calls], [greedy(len(d)) for _, d in calls])
    assert [o.token_ids for o in outs] == [d for _, d in calls]
    assert llm.stats["accepted_tokens"] > 0 and llm.stats["drafted_tokens"] > llm.stats["accepted_tokens"]


def eagle_reference_drafts(llm, hf_model, tokens: list[int], k: int) -> list[int]:
    """The head run from scratch in one pass over all elements (f_i, t_{i+1}), with the target's
    features from transformers, then k greedy steps feeding its own output back."""
    head, target = llm.engine.proposer.head, llm.model
    with torch.no_grad():
        out = hf_model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if head.version == 1:
            features = hf_model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        else:
            features = torch.cat([out.hidden_states[i][0] for i in llm.engine.proposer.capture_layers], -1)
        n = len(tokens) - 1
        cache = KVCache(1, (n + k) // 16 + 1, 16, head.config.num_kv_heads, head.config.head_dim,
                        torch.float32, "cpu")
        table = []
        cache.allocator.grow(table, n + k)   # (ids past the null and sink blocks, which no table holds)
        meta = build_metadata([table], [0], [n], 16, torch.device("cpu"))
        x = head(target.model.embed_tokens(torch.tensor(tokens[1:])), features, torch.arange(n), cache,
                 meta)[-1:]
        drafts = []
        for j in range(k):
            d = head.logits(x, target).argmax(-1)
            drafts.append(d.item())
            meta = build_metadata([table], [n + j], [1], 16, torch.device("cpu"))
            x = head(target.model.embed_tokens(d), x, torch.tensor([n + j]), cache, meta)
    return drafts


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 3])
def test_eagle_drafts_equal_the_head_run_from_scratch(spec_models, version):
    """Catch-up on prefill and verified features, rollback of predicted elements and the bonus
    case all keep the head's cache equal to one computed from scratch."""
    import transformers
    llm = LLM(spec_models["target"], device="cpu", kv_cache_gb=0.05, eagle=spec_models[f"eagle{version}"],
              num_speculative_tokens=3, max_num_batched_tokens=7)   # small chunks: features arrive in pieces
    calls = record_proposals(llm)
    llm.generate(PROMPTS[:4], greedy(12))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32)
    for tokens, drafts in calls:
        assert eagle_reference_drafts(llm, hf_model, tokens, len(drafts)) == drafts


def test_eagle_head_for_another_target_is_refused(spec_models, tmp_path):
    from conftest import write_checkpoint
    narrow = write_checkpoint(str(tmp_path / "narrow"), "llama3", hidden=32)
    with pytest.raises(NanospecError, match="hidden size 64 .* target's hidden size is 32"):
        LLM(narrow, device="cpu", kv_cache_gb=0.05, eagle=spec_models["eagle1"])


def test_not_an_eagle_head_is_refused(spec_models):
    with pytest.raises(NanospecError, match="not an EAGLE head"):
        LLM(spec_models["target"], device="cpu", kv_cache_gb=0.05, eagle=spec_models["draft"])


def test_stops_inside_an_accepted_run(spec_models, plain_greedy):
    """The target as its own draft accepts all K = 8 drafts, so each limit falls inside a run:
    nothing generated past it is returned."""
    llm = LLM(spec_models["target"], device="cpu", kv_cache_gb=0.05, draft=spec_models["target"],
              num_speculative_tokens=8)
    prompt = PROMPTS[0]
    expected = plain_greedy[prompt]
    out = llm.generate([prompt], greedy(5))[0]
    assert out.token_ids == expected[:5] and out.finish_reason == "length"
    j = next(i for i in range(3, len(expected)) if expected[i] not in expected[:i])
    llm.engine.eos_ids = {expected[j]}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    # EOS is the last id, not in text
    assert out.token_ids == expected[:j + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(expected[:j])
    llm.engine.eos_ids = set()
    stop = llm.tokenizer.decode(expected[4:6])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    full = llm.tokenizer.decode(expected)
    assert out.finish_reason == "stop" and out.text == full[:full.find(stop)]
    assert len(out.token_ids) <= 6 + 2


def test_seeded_speculative_runs_reproduce(spec_models):
    llm = LLM(spec_models["target"], device="cpu", kv_cache_gb=0.05, draft=spec_models["draft"],
              num_speculative_tokens=3)
    params = lambda seed: [SamplingParams(temperature=0.8, max_tokens=16, seed=seed + i,
                                          ignore_eos=True) for i in range(4)]
    a, b, c = (llm.generate(PROMPTS[:4], params(s)) for s in (1, 1, 2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
