"""Prefix caching (kv_cache.BlockAllocator, engine.Scheduler): a request whose prompt begins as an
earlier request's tokens did reuses their K/V, and decodes exactly what it would from a cold cache."""
import pytest
import torch

from conftest import PROMPTS, assert_no_leak, proposer_args
from nanospec import LLM, NanospecError, SamplingParams
from nanospec import kv_cache, proposer
from nanospec.hybrid import HybridProposer, StepPlans
from nanospec.kv_cache import BlockAllocator, BlockTable, KVCache


def published(tokens, alloc, num_tokens=None):
    """A table grown for `tokens` and its full blocks published."""
    table = BlockTable()
    alloc.grow(table, len(tokens))
    alloc.publish(table, tokens, len(tokens) if num_tokens is None else num_tokens)
    return table


def test_published_blocks_are_shared_until_their_last_holder_frees_them():
    alloc = BlockAllocator(num_blocks=6, block_size=4, prefix_caching=True)
    tokens = list(range(10))
    a = published(tokens, alloc)                     # 3 blocks, the 2 full ones published
    b = BlockTable()
    assert alloc.cached_prefix(b, tokens[:9] + [99]) == 8 and b == a[:2]
    assert alloc.num_free == 3                       # shared blocks are held once
    alloc.release(a)
    assert alloc.num_free == 4                       # b still holds the two shared blocks
    alloc.release(b)
    assert sorted(alloc.free_blocks) == list(range(6)) and not alloc.refs
    c = BlockTable()
    assert alloc.cached_prefix(c, tokens) == 8       # freed, still findable
    alloc.release(c)
    alloc.grow(BlockTable(), 6 * 4)                  # every block handed out again: evicted
    assert alloc.cached_prefix(BlockTable(), tokens) == 0 and not alloc.published


def test_a_block_is_found_only_after_the_same_tokens_before_it():
    alloc = BlockAllocator(num_blocks=8, block_size=2, prefix_caching=True)
    published([1, 2, 3, 4, 5], alloc)
    # the second block's tokens, another first
    assert alloc.cached_prefix(BlockTable(), [9, 9, 3, 4, 5]) == 0
    assert alloc.cached_prefix(BlockTable(), [1, 2, 3, 5, 5]) == 2     # the first block only
    # only whole blocks of the cached positions
    published([7, 7, 7, 7], alloc, num_tokens=3)
    assert alloc.cached_prefix(BlockTable(), [7, 7, 7, 7, 1]) == 2


def test_the_least_recently_freed_block_is_evicted_first():
    alloc = BlockAllocator(num_blocks=4, block_size=2, prefix_caching=True)
    a, b = published([1, 1, 2, 2], alloc), published([3, 3, 4, 4], alloc)
    alloc.release(a)       # a's deepest block first, then its first
    alloc.release(b)
    alloc.grow(BlockTable(), 2)   # takes a's deepest block
    assert alloc.cached_prefix(BlockTable(), [1, 1, 2, 2]) == 2
    assert alloc.cached_prefix(BlockTable(), [3, 3, 4, 4]) == 4


def test_clearing_the_pool_unpublishes_every_block():
    cache = KVCache(1, 4, 2, 1, 4, torch.float32, torch.device("cpu"), prefix_caching=True)
    published([1, 2, 3, 4], cache.allocator)
    cache.clear()
    assert cache.allocator.cached_prefix(BlockTable(), [1, 2, 3, 4]) == 0


def conversations(llm, num=4, turns=3, max_tokens=24):
    """Each turn's prompt is the last turn's prompt, its answer and a few more tokens; returns the
    first turn's prompts, those of every later turn, and the prefix cache's hits over them."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [llm.tokenizer.encode(f"User: question {i} about{' the fox' * i} and dogs?\nAssistant:")
               for i in range(num)]   # of several lengths: every block boundary is met somewhere
    first, later, hits = prompts, [], 0
    for _ in range(turns - 1):
        outs = llm.generate(prompts, params)
        turn = llm.tokenizer.encode("\nUser: and then?\nAssistant:")
        prompts = [p + o.token_ids + turn for p, o in zip(prompts, outs)]
        later.append(prompts)
        hits += llm.stats["prefix_cache_hits"]
    llm.generate(prompts, params)
    return first, later, hits + llm.stats["prefix_cache_hits"]


def assert_published_blocks_hold_their_tokens_kv(warm, cold, prompts):
    """Every published block on the path of each prompt holds the K/V that one prefill of the
    prompt in an empty cache computes there (to float32 rounding); returns the most blocks found on
    one prompt's path."""
    alloc, engine, size = warm.engine.kv_cache.allocator, cold.engine, warm.engine.kv_cache.block_size
    most = 0
    for tokens in prompts:
        req = engine.new_request(0, "", tokens, SamplingParams(max_tokens=1))
        engine.add_requests([req])
        engine.step()   # the prefill: every token but the last cached
        key = b""
        for i in range((len(tokens) - 1) // size):
            key = kv_cache.block_key(key, tokens[i * size:(i + 1) * size])
            if key not in alloc.published:
                break
            mine = warm.engine.kv_cache.pool[:, :, alloc.published[key]]
            theirs = engine.kv_cache.pool[:, :, req.block_table[i]]
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
            most = max(most, i + 1)
        engine.abort([req])
    return most


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("proposer", [{}, dict(ngram=True), dict(suffix=True)])
@pytest.mark.parametrize("temperature", [0, 0.9])
@pytest.mark.parametrize("num_blocks", [40, 160])
def test_cached_prefixes_decode_what_a_cold_cache_decodes(checkpoints, family, proposer, temperature,
                                                          num_blocks):
    """Later turns hit the cache (in a pool of 40 blocks of 4, after preemptions and evictions), their
    published blocks hold the K/V a cold prefill computes, and they give the tokens an engine without
    prefix caching gives, greedy and seeded sampling alike."""
    sizes = dict(device="cpu", dtype="float32", num_kv_blocks=num_blocks, block_size=4, **proposer)
    warm = LLM(checkpoints[family], **sizes)
    cold = LLM(checkpoints[family], enable_prefix_caching=False, **sizes)
    first, later, hits = conversations(warm)
    assert hits > 0
    # blocks past the first turn's prompt were published too: its answer's, written by decode steps
    found = assert_published_blocks_hold_their_tokens_kv(warm, cold, later[-1])
    assert found * warm.engine.kv_cache.block_size > max(map(len, first)) + 4
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7)
    for prompts in later:
        assert ([o.token_ids for o in warm.generate(prompts, params)]
                == [o.token_ids for o in cold.generate(prompts, params)])
        assert warm.stats["prefix_cache_hits"] > 0 and cold.stats["prefix_cache_hits"] == 0
    assert_no_leak(warm)


def test_a_key_without_the_tokens_before_it_changes_what_is_decoded(checkpoints, monkeypatch):
    """The test above fails on a broken cache: keyed by a block's own tokens only, blocks computed
    at other positions after other tokens are reused, and the output changes."""
    sizes = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    shared = list(range(40, 72))
    prompts = [[5, 6, 7, 8] + shared, shared + [1, 2]]
    cold = [LLM(checkpoints["llama3"], enable_prefix_caching=False, **sizes).generate(p, params)[0].token_ids
            for p in prompts]
    monkeypatch.setattr(kv_cache, "block_key", lambda parent, tokens: bytes(str(list(tokens)), "ascii"))
    broken = LLM(checkpoints["llama3"], **sizes)
    outs = [broken.generate(p, params)[0].token_ids for p in prompts]
    assert broken.stats["prefix_cache_hits"] == len(shared) and outs[0] == cold[0] and outs[1] != cold[1]


def proposer_blocks_hold_their_kv(warm, cold, prompts):
    """Every block of the warm model proposer's cache published on each prompt's path holds the K/V
    that the cold engine's proposer (no prefix caching) computes there by its first round; returns the
    most blocks found on one prompt's path."""
    proposer, engine = warm.engine.proposer, cold.engine
    alloc, size, shift = proposer.kv_cache.allocator, proposer.kv_cache.block_size, proposer.shift
    most = 0
    for tokens in prompts:
        req = engine.new_request(0, "", tokens, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.add_requests([req])
        while not req.decode_steps:   # the prefill, then a decode step whose round fed every prompt position
            engine.step()
        state, key = req.proposer_state, kv_cache.block_key(b"", tokens[:shift]) if shift else b""
        for i in range(state.num_cached // size):
            key = kv_cache.block_key(key, tokens[shift + i * size:shift + (i + 1) * size])
            if key not in alloc.published:
                break
            torch.testing.assert_close(proposer.kv_cache.pool[:, :, alloc.published[key]],
                                       engine.proposer.kv_cache.pool[:, :, state.block_table[i]], atol=1e-4,
                                       rtol=1e-4)
            most = max(most, i + 1)
        engine.abort([req])
    return most


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft", "eagle1", "eagle3", "hybrid_draft", "hybrid_eagle3"])
def test_model_proposers_cache_prefixes_beside_the_target(spec_models, name):
    """A draft model's and an EAGLE head's own caches: later turns skip what the target's cache
    holds (with EAGLE, only what the head's holds too: as much, its finishing requests fed the
    features of their last steps, EagleProposer.finished), the proposer's published blocks hold what a
    cold proposer computes there (its drafts, so the acceptance, depend on them; the output does
    not), and the tokens are a cold engine's."""
    sizes = dict(device="cpu", dtype="float32", num_kv_blocks=160, block_size=4)
    plain_hits = conversations(LLM(spec_models["target"], **sizes))[2]
    sizes.update(proposer_args(spec_models, name))
    warm = LLM(spec_models["target"], **sizes)
    cold = LLM(spec_models["target"], enable_prefix_caching=False, **sizes)
    first, later, hits = conversations(warm)
    assert warm.engine.proposer.kv_cache.allocator.published
    # the target skips only what the draft's cache holds too: its last tokens were never fed
    if name.endswith("draft"):
        assert 0.9 * plain_hits <= hits <= plain_hits
    else:   # EAGLE's head was fed as far, up to a request's end
        assert hits == plain_hits
    if not name.startswith("hybrid"):   # a hybrid's first round may be the suffix draft's: nothing fed yet
        assert proposer_blocks_hold_their_kv(warm, cold, later[-1]) * 4 > max(map(len, first)) + 4
    # sampled, the hybrid's tokens depend on its choices, which learn from every request
    # (docs/suffix_decoding.md)
    params = SamplingParams(temperature=0 if name.startswith("hybrid") else 0.9, max_tokens=24,
                            ignore_eos=True, seed=7)
    for prompts in later:
        assert ([o.token_ids for o in warm.generate(prompts, params)]
                == [o.token_ids for o in cold.generate(prompts, params)])
    assert_no_leak(warm)


def test_a_tight_pool_shared_prefixes_and_a_draft_model_sample_as_a_cold_cache(spec_models):
    """Requests sharing a prompt's first blocks in a pool near their need, seeded sampling: the same
    tokens as a cold cache. When the target skipped what its own cache held while the draft model
    caught up alone, the draft's pool (as large) held its own copies of the shared blocks, filled
    first, and left rows out of rounds that a cold engine drafts for (a helper's review: all 6 differed)."""
    sizes = dict(device="cpu", dtype="float32", num_kv_blocks=40, block_size=4, max_num_batched_tokens=12,
                 draft=spec_models["draft"])
    shared = list(range(50, 75))
    prompts = [shared + [3 + i] * i for i in range(4)] + [shared[:13], shared[:12]]
    params = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=4)
    warm, cold = LLM(spec_models["target"], **sizes), LLM(spec_models["target"], enable_prefix_caching=False,
                                                          **sizes)
    assert ([o.token_ids for o in warm.generate(prompts, params)]
            == [o.token_ids for o in cold.generate(prompts, params)])
    assert warm.stats["prefix_cache_hits"] > 0
    assert_no_leak(warm)


@pytest.mark.parametrize("proposer", ["draft", "self_draft"])
def test_a_request_with_nothing_to_prefill_drafts_on_its_first_step(spec_models, proposer):
    """A prompt the prefix cache holds whole (sent again) or of one token has nothing to prefill: it
    is admitted and decodes in one step, which drafts as any other. It took K = 0 where no other
    request decoded, so a seeded sample differed between a cold cache and a warm one, and between a
    request alone and beside another (a helper's review)."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              **proposer_args(spec_models, proposer))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=3)
    prompt = list(range(40, 69))
    cold = llm.generate([prompt], params)[0].token_ids
    assert llm.generate([prompt], params)[0].token_ids == cold
    assert llm.stats["prefix_cache_hits"] == len(prompt) - 1   # the whole prompt but its last token
    alone = llm.generate([[7]], params)[0].token_ids
    assert llm.generate([[7], prompt[:9]], params)[0].token_ids == alone
    assert_no_leak(llm)


def test_a_proposer_pool_without_room_drafts_nothing_for_that_request(spec_models):
    """A round takes only the rows whose proposer blocks fit (ModelProposer.with_room): with the
    draft's pool full, a step drafts for no one and decodes plainly, the same tokens."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", draft=spec_models["draft"],
              num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(PROMPTS[:2], params)
    allocator = llm.engine.proposer.kv_cache.allocator
    squatter = BlockTable()
    allocator.grow(squatter, allocator.num_free * 4)   # every free block of the draft's pool taken
    outs = llm.generate(PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected] and llm.stats["drafted_tokens"] == 0
    allocator.release(squatter)
    assert_no_leak(llm)


def test_enable_prefix_caching_takes_a_bool(spec_models):
    with pytest.raises(NanospecError, match="enable_prefix_caching must be True, False or None"):
        LLM(spec_models["target"], device="cpu", enable_prefix_caching="yes")


@pytest.mark.slow
def test_requests_prefilled_after_others_find_their_prompt_blocks(checkpoints):
    """In one call: prefill chunks of 24 tokens, so the later requests are admitted after the first
    one's shared blocks were written, and find them (the second the first chunk's 24 tokens, the
    others all 40); the tokens are a cold cache's."""
    sizes = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=24)
    shared = list(range(40, 80))
    prompts = [shared + [5 + i] * (i + 1) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    warm = LLM(checkpoints["qwen2"], **sizes)
    outs = [o.token_ids for o in warm.generate(prompts, params)]
    assert warm.stats["prefix_cache_hits"] == 24 + 2 * len(shared)
    cold = LLM(checkpoints["qwen2"], enable_prefix_caching=False, **sizes)
    assert outs == [o.token_ids for o in cold.generate(prompts, params)]


def test_a_prefill_that_wrote_non_finite_kv_publishes_nothing(checkpoints):
    llm = LLM(checkpoints["llama3"], device="cpu", dtype="float32", block_size=4, num_kv_blocks=16)
    engine, model = llm.engine, llm.engine.model
    params = SamplingParams(temperature=0, max_tokens=4)
    for poison in (False, True):
        engine.kv_cache.clear()
        req = engine.new_request(0, "", list(range(40, 50)), params)

        def forward(*args, **kwargs):   # the prefill, then (poison) a NaN in the first block's K
            out = model.__class__.__call__(model, *args, **kwargs)
            if poison:
                engine.kv_cache.pool[1, 0, req.block_table[0], 2, 0, 3] = float("nan")
            return out
        engine.model = forward
        engine.add_requests([req])
        engine.step()
        engine.model = model
        assert bool(engine.kv_cache.allocator.published) != poison   # 2 full blocks, or none
        engine.abort([req])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid_eagle1", "hybrid_eagle3"])
@pytest.mark.parametrize("absorb_at", [8, proposer.ABSORB_AT])   # the default: more than these requests hold
def test_a_priced_hybrid_without_rounds_feeds_its_head_without_drafting(spec_models, monkeypatch, name,
                                                                        absorb_at):
    """Where the priced hybrid runs no round (a slow head: its steps take the suffix drafts or none), its
    head is fed none of the target's features, which pile up:
    each row's are fed to it without drafting once ABSORB_AT are held back (their memory bounded),
    and a finishing request's are fed too, so that its head's cache is published as far as EAGLE
    alone's: later turns find what they find with EAGLE alone (without the feeding, far fewer), the
    head's published blocks hold what a cold EAGLE computes there, and the tokens are plain decoding's."""
    # no round ever
    monkeypatch.setattr(StepPlans, "choose", lambda self, batch, expected: self.chosen.update(
        suffix=self.chosen["suffix"] + 1) or "suffix" if "suffix" in expected else "plain")
    # no preemption: hits comparable
    sizes = dict(device="cpu", dtype="float32", num_kv_blocks=1024, block_size=4)
    eagle = proposer_args(spec_models, name.removeprefix("hybrid_"))
    eagle_hits = conversations(LLM(spec_models["target"], **sizes, **eagle), max_tokens=40)[2]
    monkeypatch.setattr(proposer, "ABSORB_AT", absorb_at)
    warm = LLM(spec_models["target"], **sizes, **proposer_args(spec_models, name), dynamic_k=True)   # priced
    held, choose, model = [], HybridProposer.choose, warm.engine.proposer.model

    def choose_and_note(self, requests, ks):   # and note what a step leaves held back
        chosen = choose(self, requests, ks)
        held.extend(model.catch_up_len(r, model.state(r)) for r in requests)
        return chosen
    monkeypatch.setattr(HybridProposer, "choose", choose_and_note)
    first, later, hits = conversations(warm, max_tokens=40)
    assert warm.engine.proposer.model_steps == 0 and warm.stats["drafted_tokens"] > 0
    assert 0 < max(held) < absorb_at
    assert hits >= eagle_hits
    cold = LLM(spec_models["target"], enable_prefix_caching=False, **sizes, **eagle)
    assert proposer_blocks_hold_their_kv(warm, cold, later[-1]) * 4 > max(map(len, first)) + 4
    plain = LLM(spec_models["target"], **sizes)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompts in later:
        assert ([o.token_ids for o in warm.generate(prompts, params)]
                == [o.token_ids for o in plain.generate(prompts, params)])
    assert_no_leak(warm)
