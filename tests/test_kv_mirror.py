"""The CPU attention's mirror (nanospec/kv_mirror.py) against the reference it stands in for: every
layer's output through the mirror equals, bit for bit, the reference's over the pool with that
layer's new K/V written, in engines that batch, preempt, chunk prefills, roll drafts back, pad
batches and share cached prefixes; the pool it writes at each pass's end is the pool the reference
path writes; and the tokens are the reference path's."""
from collections import Counter

import pytest
import torch

from nanospec import LLM, SamplingParams, kv_mirror
from nanospec.cuda_graph import StepOptions
from nanospec.kv_cache import SINK_BLOCK, KVCache, build_metadata, paged_attention_reference, write_kv
from nanospec.kv_mirror import KVMirror

from conftest import PROMPTS, assert_no_leak, proposer_args


@pytest.fixture
def checked(monkeypatch):
    """Every layer that attends through a mirror is checked against the reference; the counts of
    those layers and of the blocks they copied in from the pool. Every token, a static step's
    padding ones too (which read slots past their row's context)."""
    counts = Counter()
    mirrored = KVMirror.attention

    def attention(self, layer, plan, q, k, v, meta, scale):
        pages = self.pool[layer].clone()   # the pool before this pass: the mirror writes it last
        write_kv(pages[0], pages[1], k, v, meta.slot_mapping)
        expected = paged_attention_reference(q, pages, meta, scale)
        out = mirrored(self, layer, plan, q, k, v, meta, scale)
        assert torch.equal(out, expected), (layer, (out - expected).abs().max())
        counts["layers"] += 1
        counts["copied blocks"] += 0 if plan.copy is None else len(plan.copy[0])
        return out
    monkeypatch.setattr(KVMirror, "attention", attention)
    return counts


def workload(llm):
    """Greedy and seeded sampled requests of mixed lengths, then later turns that extend them (their
    prefixes cached); returns every output's tokens."""
    params = [SamplingParams(temperature=0.8 if i % 3 else 0, top_p=0.9, seed=i, max_tokens=12 + 3 * i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    later = [llm.tokenizer.decode(llm.tokenizer.encode(p) + o.token_ids) + " and then"
             for p, o in zip(PROMPTS, outs)]
    return [o.token_ids for o in outs] + [o.token_ids for o in llm.generate(later, params)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "ngram", "suffix", "draft", "eagle1", "eagle3", "suffix_tree",
                                  "draft_tree", "eagle1_tree"])
def test_every_mirrored_layer_equals_the_reference_and_so_do_the_pool_and_the_tokens(spec_models, checked,
                                                                                     monkeypatch, name):
    """A pool small enough to preempt, prefills in chunks of 8 tokens, 5 running at most (rows
    change as requests finish and join), drafts of 3 (rejected ones rolled back), later turns that
    find their prefixes cached, draft trees (an EAGLE-2 frontier's rows share their request's blocks of
    4 slots): the mirror's layers equal the reference's throughout, its engine's tokens are the
    reference engine's, and both pools end the same (but the sink, padding's)."""
    args = dict(device="cpu", dtype="float32", num_kv_blocks=48, block_size=4, max_num_seqs=5,
                max_num_batched_tokens=8,
                **(proposer_args(spec_models, name.removesuffix("_tree")) if name != "plain" else {}),
                **({"speculative_topk": 2} if name.endswith("tree") else {}),
                **({"speculative_num_steps": 3} if name in ("draft_tree", "eagle1_tree") else {}),
                **({"num_speculative_tokens": 3} if name != "plain" else {}),
                # (suffix's offset is priced by step times: not repeatable)
                **({"suffix_max_spec_offset": 0} if name.startswith("suffix") else {}))
    mirrored = LLM(spec_models["target"], **args)
    got = workload(mirrored)
    assert checked["layers"] and checked["copied blocks"]   # the mirror ran, and copied blocks in
    assert mirrored.stats["preemptions"] > 0 and mirrored.stats["prefix_cache_hits"] > 0
    layers = checked["layers"]
    reference = LLM(spec_models["target"], step_options=StepOptions(pad_batches=True, kv_mirror=False),
                    **args)
    assert workload(reference) == got
    assert checked["layers"] == layers   # the reference engine never went through a mirror
    for mine, theirs in zip(caches(mirrored), caches(reference)):
        assert torch.equal(mine.pool[:, :, SINK_BLOCK + 1:], theirs.pool[:, :, SINK_BLOCK + 1:])
    assert_no_leak(mirrored)


def caches(llm):
    proposer = getattr(llm.engine.proposer, "model", llm.engine.proposer)   # a hybrid's model proposer
    return [llm.engine.kv_cache] + ([proposer.kv_cache] if hasattr(proposer, "kv_cache") else [])


def test_a_mirror_past_its_budget_gives_way_to_the_reference(spec_models, checked, monkeypatch):
    """Where the mirror would grow past its budget the pass takes the reference (the mirror is
    dropped), and the tokens are the same."""
    args = dict(device="cpu", dtype="float32", num_kv_blocks=48, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in LLM(spec_models["target"], **args).generate(PROMPTS, params)]
    monkeypatch.setattr(kv_mirror, "MIN_BUDGET", 0)   # the pool's size: too small for 8 rows here
    reference, passes = kv_mirror.paged_attention_reference, Counter()
    monkeypatch.setattr(kv_mirror, "paged_attention_reference",
                        lambda q, kv, meta, scale: passes.update([len(meta.context_lens)])
                        or reference(q, kv, meta, scale))
    assert [o.token_ids for o in LLM(spec_models["target"], **args).generate(PROMPTS, params)] == expected
    # steps of all 8 took the reference; smaller ones the mirror
    assert passes[8] > 0 and checked["layers"] > 0, passes


def test_writing_the_pool_outside_a_pass_drops_the_mirror(spec_models):
    """clear() and zero_blocks() write the pool behind the mirror's back: the mirror goes with them."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=48, block_size=4)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    cache = llm.engine.kv_cache
    assert cache.mirror is not None
    cache.zero_blocks(torch.tensor([2]))
    assert cache.mirror is None
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4))
    assert cache.mirror is not None
    cache.clear()
    assert cache.mirror is None


def test_a_requests_nan_reaches_no_other_request_through_the_mirror(spec_models):
    """A request whose K/V are NaN (a NaN embedding row) prefills in chunks alone in the mirror's
    first row; the next step puts a shorter request in that row, whose masked keys past its context
    are that row's slots. A masked key weighs 0, and 0 * NaN is NaN: the mirror copies every block of
    a row's table, the null block past its own, so the short request reads what the reference reads
    and only the poisoned one fails, as with the reference."""
    def finishes(mirror: bool):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=48, block_size=4,
                  max_num_batched_tokens=8, step_options=StepOptions(pad_batches=True, kv_mirror=mirror))
        with torch.no_grad():
            llm.model.model.embed_tokens.weight[200] = float("nan")
        engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        short = engine.new_request(0, "", [5, 6, 7], params)
        poisoned = engine.new_request(1, "", list(range(10, 20)) + [200] + list(range(20, 29)), params)
        engine.add_requests([short, poisoned])
        while engine.scheduler.has_work():
            engine.step()
        return short.finish_reason, poisoned.finish_reason
    assert finishes(False) == finishes(True) == ("length", "error")


def test_a_mirror_made_in_inference_mode_serves_a_no_grad_pass(spec_models):
    """The mirror's tensors are normal ones, as the pool is: a pass under no_grad after one under
    inference_mode writes them as well (an inference tensor refuses in-place writes outside it)."""
    model = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=48, block_size=4).model
    cfg = model.config
    cache = KVCache(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    table = []

    def forward(cached: int, new: int):
        cache.allocator.grow(table, cached + new)
        meta = build_metadata([table], [cached], [new], 4, torch.device("cpu"))
        return model(torch.arange(10, 10 + new), meta.positions, cache, meta)[0]
    with torch.inference_mode():
        forward(0, 5)
    assert cache.mirror is not None and not cache.mirror.kv.is_inference()
    with torch.no_grad():
        forward(5, 1)
    assert cache.mirror is not None
