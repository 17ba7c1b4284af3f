"""Suffix decoding's index against the structure it stands for: a suffix tree of the token streams
with a count per node, built here the plain way (a dict per node), and walked by the rule the
proposer states (the most frequent child, the path's probability at least MIN_TOKEN_PROB, at most
L * MAX_SPEC_FACTOR + offset tokens after a match of L, the best score over every L). Then the
global index's bound (oldest dropped first), the hybrid's measured threshold and the extra tokens'
price. Losslessness over both proposers is in test_speculative and test_exact_sampling_end_to_end
(PROPOSERS)."""
import functools
import random
from collections import Counter

import pytest

from benchmarks.suffix_costs import index_nbytes
from nanospec import LLM, SamplingParams
from nanospec.hybrid import PROBE_EVERY, StepPlans
from nanospec.suffix import (EXTRA_PROBE_EVERY, EXTRA_TOKENS, MAX_DEPTH, MAX_SPEC_FACTOR, MIN_TOKEN_PROB,
                             RUN_SEGMENTS, Draft, ExtraTokens, GlobalIndex, RequestStream)

from conftest import PROMPTS, greedy
from conftest import tree_path
from nanospec.tree import child_ranks as tree_ranks


def trie(streams: list[list[int]], depth: int) -> dict:
    """Every suffix of every stream, cut at `depth` tokens, in a trie; node: {"n": count, token: child}.
    A stream's last token has no continuation: occurrences count where a continuation starts."""
    root = {"n": 0}
    for stream in streams:
        for start in range(len(stream)):
            node = root
            for token in stream[start:start + depth]:
                node = node.setdefault(token, {"n": 0})
                node["n"] += 1
    return root


def oracle_draft(streams, context, k, min_match, context_in_streams=False, offset=0):
    """The best (score, tokens) over match lengths L >= min_match, by the stated rule, on a trie.
    context_in_streams: the context is the end of streams[0] (a request's own stream), and its own
    occurrence, which ends at the matched node, is no earlier occurrence: it leaves the count."""
    best = (0.0, [])
    tree = trie(streams, MAX_DEPTH + k)
    for length in range(min_match, min(MAX_DEPTH, len(context)) + 1):
        node = tree
        for token in context[-length:]:
            node = node.get(token)
            if node is None:
                return best
        tokens, score, prob = [], 0.0, 1.0
        count = node["n"] - context_in_streams
        for _ in range(min(k, int(length * MAX_SPEC_FACTOR + offset))):
            children = {t: c["n"] for t, c in node.items() if t != "n"}
            if not children:
                break
            token = min(children, key=lambda t: (-children[t], t))   # most frequent, then the smallest id
            prob *= children[token] / count
            if prob < MIN_TOKEN_PROB:
                break
            tokens.append(token)
            score += prob
            node = node[token]
            count = node["n"]
        if score > best[0] or (score == best[0] and score > 0):   # ties: the longer match
            best = (score, tokens)
    return best


def random_stream(rng, n, vocab):
    """Text-like: runs copied from earlier in the stream, with fresh tokens between."""
    out = [rng.randrange(vocab) for _ in range(4)]
    while len(out) < n:
        if rng.random() < 0.5:
            start = rng.randrange(len(out))
            out += out[start:start + rng.randrange(1, 12)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


@pytest.mark.parametrize("offset", [0, 3])   # vLLM's default; prompt lookup's reach after a short match
@pytest.mark.parametrize("seed", range(40))
def test_a_requests_draft_is_its_suffix_trees_best_path(seed, offset):
    rng = random.Random(seed)
    tokens = random_stream(rng, rng.randrange(2, 300), rng.choice([3, 8, 50]))
    k = rng.randrange(1, 9)
    stream = RequestStream()
    stream.sync(tokens)
    draft = stream.draft(k, offset=offset)
    score, expected = oracle_draft([tokens], tokens, k, 1, context_in_streams=True, offset=offset)
    assert draft.tokens == expected and draft.score == pytest.approx(score)


def oracle_tree_score(streams, context, k, branches, limit_offset=0, shape=None):
    """The best tree's score over match lengths L >= 1 of a request's own stream (streams[0] ends with
    the context), by the stated rule on a trie: the nodes a draft may hold are the paths whose every
    step is among its parent's `branches` most frequent continuations (or, with a static shape, the
    continuation of each shape node's rank), at most L * factor + offset deep, each of probability >=
    MIN_TOKEN_PROB; a tree's score is the sum of its k most probable ones. Returns (score, trie node of
    each match length, limit)."""
    tree = trie(streams, MAX_DEPTH + k)
    best = 0.0
    for length in range(1, min(MAX_DEPTH, len(context)) + 1):
        node = tree
        for token in context[-length:]:
            node = node.get(token)
            if node is None:
                return best
        limit = min(k, int(length * MAX_SPEC_FACTOR + limit_offset))
        probs = []

        def visit(node, count, prob, depth, at):
            ranked = sorted(((t, c["n"]) for t, c in node.items() if t != "n"),
                            key=lambda tc: (-tc[1], tc[0]))
            ranks = ([(r, i) for i, (p, r) in enumerate(zip(shape, tree_ranks(shape))) if i and p == at]
                     if shape else [(r, 0) for r in range(branches)])
            for rank, shape_node in ranks:
                if rank < len(ranked) and depth < limit:
                    token, c = ranked[rank]
                    if prob * c / count >= MIN_TOKEN_PROB:
                        probs.append(prob * c / count)
                        visit(node[token], node[token]["n"], prob * c / count, depth + 1, shape_node)
        visit(node, node["n"] - 1, 1.0, 0, 0)   # the context's own occurrence ends at the node
        best = max(best, sum(sorted(probs, reverse=True)[:k]))
    return best


@pytest.mark.parametrize("shape", [None, [-1, 0, 0, 1, 1, 2, 3]], ids=["grown", "static"])
@pytest.mark.parametrize("branches", [2, 3])
@pytest.mark.parametrize("seed", range(30))
def test_a_requests_tree_is_its_suffix_trees_best(seed, branches, shape):
    """Trees: the best score over match lengths, and every node a path of the request's own suffix
    tree under the matched context (so the tree's tokens are continuations that occurred)."""
    rng = random.Random(seed)
    tokens = random_stream(rng, rng.randrange(2, 300), rng.choice([3, 8, 50]))
    k = len(shape) - 1 if shape else rng.randrange(2, 9)
    stream = RequestStream()
    stream.sync(tokens)
    draft = stream.draft(k, offset=3, branches=branches, shape=shape)
    assert draft.score == pytest.approx(oracle_tree_score([tokens], tokens, k, branches, 3, shape))
    if draft.tokens:
        parents = draft.parents
        assert len(parents) == len(draft.tokens) + 1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        for node in range(1, len(parents)):
            path = [draft.tokens[n - 1] for n in tree_path(parents, node)]
            assert any(tokens[i:i + len(path)] == path for i in range(1, len(tokens)))   # it occurred


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("seed", range(40))
def test_the_global_draft_is_the_best_path_over_every_earlier_request(seed, offset):
    rng = random.Random(seed)
    vocab = rng.choice([4, 20, 100])
    requests = [random_stream(rng, rng.randrange(1, 60), vocab) for _ in range(rng.randrange(1, 40))]
    index = GlobalIndex(max_requests=16)   # segments of one request: counts add up across segments
    for r in requests:
        index.add(r)
    kept = requests[-index.num_requests:]
    context, k = random_stream(rng, rng.randrange(2, 30), vocab), rng.randrange(1, 9)
    draft = index.draft(context, k, offset=offset)
    score, expected = oracle_draft(kept, context, k, 2, offset=offset)
    assert draft.tokens == expected and draft.score == pytest.approx(score)


def test_the_global_index_drops_the_oldest_requests_first():
    index = GlobalIndex(max_requests=64)
    marked = lambda i: [1000 + i, 2000 + i, 3000 + i, 4000 + i, 5000 + i]   # found only in request i
    for i in range(1000):
        index.add(marked(i))
        assert index.num_requests <= 64
    assert index.num_requests > 64 - 64 // 16 - 1   # it drops a segment (1/16 of the bound) at a time
    assert index.draft(marked(999)[:2], 3).tokens == marked(999)[2:4]   # a match of 2 earns 2 drafts
    assert index.draft(marked(999 - index.num_requests + 1)[:2], 3).tokens
    assert index.draft(marked(999 - index.num_requests)[:2], 3).tokens == []
    assert index_nbytes(index) < 64 * 16 * 7 + 50_000   # 16 bytes a token sealed, the open segment's dict


@pytest.mark.parametrize("max_tokens", [40, 50_000, 300_000])
def test_a_token_bound_below_a_segment_drops_the_oldest_requests_not_all(max_tokens):
    """max_tokens under the default segment (2^17 tokens): the index still holds at most max_tokens
    tokens, drops its oldest requests first and never empties itself to keep the bound (when a
    segment could outgrow the bound, dropping the oldest one dropped every one, the newest too)."""
    index = GlobalIndex(max_tokens=max_tokens)
    marked = lambda i: [i * 2000 + j for j in range(1500)]   # request i's tokens: found only in it
    for i in range(60):
        index.add(marked(i))
        assert index.num_tokens <= max_tokens and index.num_requests >= 1
        # a request longer than a segment keeps its end
        kept = lambda r: marked(r)[-(index.segment_tokens - 1):]
        if len(kept(i)) >= 4:
            newest, oldest = kept(i), kept(i - index.num_requests + 1)
            assert index.draft(newest[-4:-2], 2).tokens == newest[-2:]
            assert index.draft(oldest[-4:-2], 2).tokens == oldest[-2:]
            if i >= index.num_requests:
                assert index.draft(kept(i - index.num_requests)[-4:-2], 2).tokens == []


@pytest.mark.parametrize("seed", range(12))
def test_each_sealed_run_is_every_bigram_of_its_segments_sorted_by_key_then_position(seed):
    """Sealing merges a segment's bigrams into the newest run's sorted arrays and dropping cuts the
    oldest segment out of the oldest run: after any mix of both, each run is what sorting every
    bigram of its stream gives (so each key's most recent occurrences end its stretch), and the
    runs hold the segments the bounds keep."""
    rng = random.Random(seed)
    index = GlobalIndex(max_requests=rng.choice([16, 64]), max_tokens=rng.choice([300, 1 << 23]),
                        segment_tokens=rng.choice([8, 40, 1 << 17]))
    for _ in range(rng.randrange(1, 160)):
        index.add(random_stream(rng, rng.randrange(1, 30), rng.choice([3, 20])))
        for run in index.runs:
            tokens = run.tokens.tolist()   # bigrams that start at a separator are never looked up: left out
            # (key, the position after the bigram ending at j)
            pairs = sorted((a << 32 | b & 0xFFFFFFFF, j + 1)
                           for j, (a, b) in enumerate(zip(tokens, tokens[1:]), 1) if a >= 0)
            assert [(key, at) for key, at in zip(run.keys.tolist(),
                                                 run.follows.tolist()) if key >= 0] == pairs
            assert len(run.tokens) == sum(size for size, _ in run.segments)
            assert 0 < len(run.segments) <= RUN_SEGMENTS
        assert index.num_requests == sum(n for _, n in index.segments) + index.open_requests
        assert index.num_tokens == sum(size for size, _ in index.segments) + index.open_size


@pytest.mark.parametrize("max_requests,segment_tokens", [(1000, 64), (1600, 1 << 17)])
def test_the_global_index_reads_a_frequent_keys_most_recent_occurrences(max_requests, segment_tokens):
    """A key seen more than MAX_CANDIDATES times drafts from its most recent occurrences, across
    runs, segments and the open one, and within a run (segments of 100 requests: the oldest run
    holds 300 old and 100 new): the 256 most recent all continue one way, the older ones another."""
    index = GlobalIndex(max_requests=max_requests, segment_tokens=segment_tokens)
    for i in range(610):
        index.add([7, 8, 1, 2] if i < 300 else [7, 8, 3, 4])
    assert len(index.runs) > 1 and index.open_requests
    assert index.draft([7, 8], 2) == Draft([3, 4], 2.0, probs=[1.0, 1.0])


@pytest.mark.parametrize("seed", range(12))
def test_a_batchs_global_drafts_are_each_requests_own(seed):
    """drafts() looks a batch up at once: each context's draft is the trie's best path over the
    requests kept, whatever the batch (short contexts and K = 0 draft nothing)."""
    rng = random.Random(seed)
    vocab = rng.choice([4, 20])
    index = GlobalIndex(max_requests=32, segment_tokens=rng.choice([64, 200, 1 << 17]))   # no request cut
    requests = [random_stream(rng, rng.randrange(1, 60), vocab) for _ in range(rng.randrange(1, 80))]
    for r in requests:
        index.add(r)
    kept = requests[-index.num_requests:]
    contexts = [random_stream(rng, rng.randrange(1, 30), vocab) for _ in range(rng.randrange(1, 20))]
    ks = [rng.choice([0, 1, 4, 8]) for _ in contexts]
    drafts = index.drafts(contexts, ks)
    for context, k, draft in zip(contexts, ks, drafts):
        score, expected = oracle_draft(kept, context, k, 2) if len(context) >= 2 and k else (0.0, [])
        assert draft.tokens == expected and draft.score == pytest.approx(score)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 3])
def test_suffix_sampled_output_is_plain_sampling_output_whatever_the_index_holds(spec_models, offset):
    """Other requests fill the global index first (the same prompts: long drafts); seeded sampled
    output is still plain sampling's token for token, and greedy output plain greedy's, whatever
    the drafts' length rule (the offset: more drafts after a short match)."""
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              num_speculative_tokens=6, suffix=True, suffix_max_spec_offset=offset)
    assert llm.engine.proposer.walk_args["offset"] == offset
    llm.generate(PROMPTS, greedy(30))
    assert llm.engine.proposer.global_index.num_requests == len(PROMPTS)
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=30, ignore_eos=True)
              for s, (t, p) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.5, 0.5)] * 2)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(30))] == \
        [o.token_ids for o in plain.generate(PROMPTS, greedy(30))]
    assert llm.stats["mean_acceptance_length"] > 3   # the second greedy pass redrafts the first's outputs


def test_vllms_suffix_settings_reach_the_index_and_the_walk(spec_models):
    """suffix_max_cached_requests, _max_spec_factor and _min_token_prob (vLLM's suffix_decoding_*):
    0 requests cached keeps the global index empty (drafts come from each request's own tokens, as
    vLLM's 0 disables its global tree), and the walk takes the factor and the probability; greedy
    output stays plain decoding's."""
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
              suffix_max_cached_requests=0, suffix_max_spec_factor=2.0, suffix_min_token_prob=0.3)
    proposer = llm.engine.proposer
    assert proposer.walk_args == dict(min_prob=0.3, factor=2.0, offset=EXTRA_TOKENS, branches=1, shape=None)
    assert [o.token_ids for o in llm.generate(PROMPTS * 2, greedy(30))] == \
        [o.token_ids for o in plain.generate(PROMPTS * 2, greedy(30))]
    assert proposer.global_index.num_requests == 0 and llm.stats["drafted_tokens"] > 0
    cached = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
                 suffix_max_cached_requests=3)
    cached.generate(PROMPTS * 2, greedy(10))
    index = cached.engine.proposer.global_index
    assert index.max_requests == 3 and index.num_requests


def test_the_hybrid_threshold_follows_measured_acceptance(spec_models):
    """With the target as its own draft (every draft accepted) the model's drafts win unless the
    suffix draft is nearly certain; with a random draft (almost none accepted) a weak suffix match
    wins. Neither threshold is set by hand: both come from what the run accepted."""
    thresholds = {}
    for name, draft in (("self", spec_models["target"]), ("random", spec_models["draft"])):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
                  num_speculative_tokens=4, suffix=True, draft=draft)
        llm.generate(PROMPTS * 2, greedy(30))
        thresholds[name] = llm.engine.proposer.threshold(4)
    assert thresholds["self"] is None or thresholds["self"] >= 3.5
    assert thresholds["random"] is not None and thresholds["random"] <= 1.0


def test_step_plans_choose_by_goodput_and_probe_the_others():
    """Seconds per plan fitted per batch size as a line in the drafts a request verifies: the plan
    of most tokens per second wins, a short suffix draft priced as short; every PROBE_EVERY-th step
    runs another plan, in turn."""
    plans = StepPlans()
    for _ in range(20):   # at batch 2: plain 1.0 s, suffix 1.0 + 0.5 s a draft, the round's plan 4.0 s
        for drafts in (1.0, 5.0):
            plans.observe(2, "suffix", drafts, 1.0 + 0.5 * drafts)
        plans.observe(2, "plain", 0.0, 1.0)
        plans.observe(2, "mixed", 4.0, 4.0)
    pick = functools.partial(plans.choose, 2)
    assert pick(dict(plain=(2, 0), suffix=(3.5, 1.0), mixed=(6, 4))) == "suffix"   # 3.5 / 1.5; 2 / 1, 6 / 4
    # 3.5 / 3.5: a long draft costs
    assert pick(dict(plain=(2, 0), suffix=(3.5, 5.0), mixed=(6, 4))) == "plain"
    assert pick(dict(plain=(2, 0), suffix=(3.5, 5.0), mixed=(10, 4))) == "mixed"   # 10 / 4
    runs = [pick(dict(plain=(2, 0), suffix=(3.5, 1.0), mixed=(6, 4))) for _ in range(2 * PROBE_EVERY)]
    assert Counter(runs) == {"suffix": 2 * PROBE_EVERY - 2, "plain": 1, "mixed": 1}


def test_the_priced_hybrid_skips_a_round_that_does_not_pay(spec_models):
    """A random draft model (its drafts almost never accepted) under dynamic K: after the first
    steps, which measure every plan, the round runs only when a probe asks for it."""
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
              draft=spec_models["draft"], dynamic_k=True)
    llm.generate(PROMPTS * 2, greedy(30))
    plans = llm.engine.proposer.plans
    assert plans.chosen["mixed"] <= 1 + sum(plans.steps.values()) // PROBE_EVERY + 2, plans.chosen
    assert plans.chosen["suffix"] + plans.chosen["plain"] > 4 * plans.chosen["mixed"], plans.chosen


def test_k_under_dynamic_k_is_suffix_decodings_ceiling_and_the_others_largest_choice():
    """Suffix decoding drafts as far as its match is strong, with or without dynamic K (a long copy at
    batch 1 gains from a K of 16); n-gram's dynamic K chooses up to 8."""
    from nanospec.llm import DEFAULT_DYNAMIC_MAX_K, MAX_SPECULATIVE_TOKENS, SpeculativeConfig
    assert SpeculativeConfig(suffix=True, draft="d", dynamic_k=True).validate() == MAX_SPECULATIVE_TOKENS
    assert SpeculativeConfig(suffix=True, dynamic_k=True).validate() == MAX_SPECULATIVE_TOKENS
    assert SpeculativeConfig(ngram=True, dynamic_k=True).validate() == DEFAULT_DYNAMIC_MAX_K


def priced_extra_tokens(step_cost: float, accept: float, steps: int = 400) -> list[int]:
    """ExtraTokens(3) over synthetic steps of one request: a draft of 0-3 tokens its match earns (all
    accepted), then the extra tokens allowed, each accepted with probability `accept` if the ones before
    were; the step takes 1 + step_cost * drafts. Returns how many extras each step allowed."""
    extras, rng, allowed = ExtraTokens(3), random.Random(0), []
    for _ in range(steps):
        n = extras.allowed(1)
        allowed.append(n)
        base = rng.randrange(4)
        accepted = base + next((i for i in range(n) if rng.random() >= accept), n)
        extras.observe([Draft([0] * (base + n), extra=n)], [base + n], [accepted], 1 + step_cost * (base + n))
    return allowed


def test_extra_tokens_count_only_what_a_step_verified_of_them():
    """A draft's extra tokens are its last ones: the step's verified count can fall short of the
    draft (a row cut near its end) or pass it (drafts padded to K); only the extras verified count,
    accepted as far as the acceptance reached."""
    extras = ExtraTokens(3)
    draft = Draft([5, 6, 7, 8, 9], extra=3)   # 2 earned, 3 extra
    # padded to K = 7, all 5 accepted: each extra drafted and accepted
    extras.observe([draft], [7], [5], 1.0)
    assert extras.drafted == [1, 1, 1] and extras.accepted == [1, 1, 1]
    extras.observe([draft], [3], [3], 1.0)    # cut to 3: only the first extra verified, and accepted
    assert extras.drafted == [2, 1, 1] and extras.accepted == [2, 1, 1]
    extras.observe([draft], [0], [0], 1.0)    # verified nothing: no extra counts
    assert extras.drafted == [2, 1, 1] and extras.accepted == [2, 1, 1]


def test_extra_tokens_are_drafted_where_their_acceptance_pays_for_their_verification():
    """Verifying a token at 1% of a step, extras accepted half the time: all 3 are drafted. At 30% of
    a step, accepted 30% of the time (a token worth 0.3 against ~0.45 tokens of step time): none,
    but on the probe steps that keep them measured. Never accepted, at 5% of a step: none."""
    probe = lambda i: (i + 1) % EXTRA_PROBE_EVERY == 0
    cheap, costly, useless = (priced_extra_tokens(*args) for args in ((0.01, 0.5), (0.3, 0.3), (0.05, 0.0)))
    assert all(n == 3 for n in cheap[50:])
    assert all(n == (3 if probe(i) else 0) for i, n in enumerate(costly) if i >= 50)
    assert all(n == (3 if probe(i) else 0) for i, n in enumerate(useless) if i >= 100)
