"""The decode step on static buffers (cuda_graph.py): the padded, bucketed step that a GPU replays
as a graph computes what an unpadded forward computes, and the engine through it keeps its
invariants. On CPU the step body runs eagerly on the same buffers; the CUDA-only tests at the end
compare graph replays with --enforce-eager and count copies on the device."""
import dataclasses
import random

import pytest
import torch

from conftest import PADDED, PROMPTS, assert_no_leak, greedy, proposer_args
from nanospec import LLM, SamplingParams, checkpoint, cuda_graph
from nanospec.dynamic_k import Profile
from nanospec.estimators import StepTimes
from nanospec.request import Request
from nanospec.cuda_graph import StepOptions
from nanospec.kv_cache import NULL_BLOCK, SINK_BLOCK, BlockTable, KVCache, build_metadata
from nanospec.dynamic_k import past_prefill
from nanospec.sampler import Sampler

CPU = torch.device("cpu")
BLOCK = 4


class LogitsOut:
    """A proposer stand-in whose "features" are the target's logits of every query row: the padded
    step's logits come out through the channel EAGLE's features use."""
    capture_layers = ()
    needs_features = True

    def __init__(self, model):
        self.model = model

    def features(self, hidden, captured):
        return self.model.logits(hidden)


def request(i: int, tokens: list[int]) -> Request:
    params = SamplingParams(temperature=0)
    return Request(i, "", tokens, params, seed=i, max_len=10_000, tokens=list(tokens))


def prefill(model, cache: KVCache, reqs: list[Request]) -> None:
    """Cache all but each request's last token, unpadded."""
    lens = [len(r.tokens) - 1 for r in reqs]
    for r, n in zip(reqs, lens):
        cache.allocator.grow(r.block_table, n)
    meta = build_metadata([r.block_table for r in reqs], [0] * len(reqs), lens, BLOCK, CPU)
    model(torch.tensor([t for r in reqs for t in r.tokens[:-1]]), meta.positions, cache, meta)
    for r, n in zip(reqs, lens):
        r.num_cached = n


def unpadded_logits(model, cache: KVCache, reqs, drafts: list[list[int]]) -> list[torch.Tensor]:
    """The verify forward as a flat batch of exactly each request's 1 + num_draft tokens."""
    lens = [1 + len(d) for d in drafts]
    meta = build_metadata([r.block_table for r in reqs], [r.num_cached for r in reqs], lens, BLOCK, CPU)
    ids = torch.tensor([t for r, d in zip(reqs, drafts) for t in [r.tokens[-1], *d]])
    hidden, _ = model(ids, meta.positions, cache, meta)
    return model.logits(hidden).split(lens)


@pytest.fixture(scope="module", params=["float64", "float32"])
def model(request, checkpoints):
    dtype = getattr(torch, request.param)
    return checkpoint.build_model(checkpoint.read_checkpoint(checkpoints["qwen3"]), CPU, dtype)


@pytest.mark.parametrize("seed", range(12))
def test_padded_step_equals_unpadded(model, seed):
    """Random batches of 1..40 (straddling the buckets 1, 2, 4, 8, 16, 24, 32, 40), K 0..8 with
    fewer drafts for some requests, contexts across block boundaries (block size 4): the padded
    step's logits equal the unpadded forward's (float64: to rounding; float32: its greedy tokens
    and accepted counts), it writes the same K/V to the requests' blocks, and its padding touches
    only the sink block."""
    rng = random.Random(seed)
    batch, k = rng.randint(1, 40), rng.randint(0, 8)
    cfg, vocab = model.config, model.config.vocab_size
    cache = KVCache(cfg.num_layers, 40 * 20, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                    model.model.norm.weight.dtype, CPU)
    reqs = [request(i, [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]) for i in range(batch)]
    drafts = [[rng.randrange(vocab) for _ in range(rng.choice([k, rng.randint(0, k)]))] for _ in reqs]
    with torch.inference_mode():
        prefill(model, cache, reqs)
        for r, d in zip(reqs, drafts):
            cache.allocator.grow(r.block_table, r.num_cached + len(d) + 1)
        reference_cache = KVCache(cfg.num_layers, 40 * 20, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                                  cache.pool.dtype, CPU)
        reference_cache.pool.copy_(cache.pool)
        expected = unpadded_logits(model, reference_cache, reqs, drafts)
        steps = cuda_graph.StepGraphs(model, cache, vocab, 40, 200, CPU, Sampler(compile=False),
                                      LogitsOut(model), options=PADDED)
        steps.upload(reqs, [len(d) for d in drafts], drafts)
        out, logits, _ = steps.run()
    q_len = max(len(d) for d in drafts) + 1
    assert out.shape[0] == steps.bucket(batch) and logits.shape[0] == steps.bucket(batch) * q_len
    for b, (r, d) in enumerate(zip(reqs, drafts)):
        got = logits[b * q_len:b * q_len + len(d) + 1]
        target_ids = expected[b].argmax(-1).tolist()
        accepted = next((i for i, t in enumerate(d) if t != target_ids[i]), len(d))
        tokens, num_accepted, broken = out[b, :q_len].tolist(), out[b, -2].item(), out[b, -1].item()
        assert (num_accepted, tokens[:accepted + 1], broken) == (accepted, target_ids[:accepted + 1], 0)
        if model.model.norm.weight.dtype == torch.float64:
            torch.testing.assert_close(got, expected[b], rtol=1e-12, atol=1e-12)
    real = torch.ones(cache.pool.shape[2], dtype=torch.bool)
    real[SINK_BLOCK] = False
    torch.testing.assert_close(cache.pool[:, :, real], reference_cache.pool[:, :, real], rtol=1e-12,
                               atol=1e-6)


def test_capture_warm_ups_write_only_the_sink_block(model):
    """capture_all warms each graph up on inputs that are all padding rows (CUDA runs the body once
    before capturing it): run here at full width, as a capture does, they leave every block a
    request can own as it was, and the null block zero: they write the sink block only."""
    cfg = model.config
    cache = KVCache(cfg.num_layers, 30, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.model.norm.weight.dtype,
                    CPU)
    cache.pool.normal_()
    cache.pool[:, :, NULL_BLOCK] = 0
    before = cache.pool.clone()
    steps = cuda_graph.StepGraphs(model, cache, cfg.vocab_size, 8, 64, CPU, Sampler(compile=False),
                                  options=PADDED)
    table = BlockTable()   # a running request's table in device row 0, which padding must not touch
    cache.allocator.grow(table, 10 * BLOCK)
    _, pairs = steps.tables.updates([table])
    steps.flat_tables[torch.tensor(pairs[0::2])] = torch.tensor(pairs[1::2])
    with torch.inference_mode():
        for bucket in (8, 1):
            for k in (3, 0):
                steps.grow(k)
                steps.upload_padding(bucket, k)
                steps.verify_body(cuda_graph.GraphKey("verify", bucket, k), steps.tables.width)
    assert torch.equal(cache.pool[:, :, SINK_BLOCK + 1:], before[:, :, SINK_BLOCK + 1:])
    assert (cache.pool[:, :, NULL_BLOCK] == 0).all() and not torch.equal(cache.pool, before)


def test_buckets_cover_every_batch():
    buckets = cuda_graph.batch_buckets(256)
    assert buckets[:6] == [1, 2, 4, 8, 16, 24] and buckets[-1] == 256 and 64 in buckets and 80 in buckets
    assert cuda_graph.batch_buckets(5)[-1] == 8
    assert all(b in buckets for b in (1, 2, 4, 8)) and len(buckets) == len(set(buckets))


def test_null_block_is_never_handed_out():
    cache = KVCache(1, 9, BLOCK, 1, 8, torch.float32, CPU)
    table = BlockTable()
    cache.allocator.grow(table, 9 * BLOCK)
    assert sorted(table) == list(range(2, 11)) and cache.pool.shape[2] == 11 and cache.allocator.num_free == 0


def test_device_tables_follow_truncate_and_grow():
    """A table truncated and grown again between two steps gets its new ids on the device, though
    its length is what it was (only the ids past `synced` are sent)."""
    tables = cuda_graph.DeviceBlockTables(torch.zeros(2 + 5 * 6, dtype=torch.long), 2, 4, 6)
    cache = KVCache(1, 12, BLOCK, 1, 8, torch.float32, CPU)
    a, b = BlockTable(), BlockTable()
    cache.allocator.grow(a, 3 * BLOCK)
    cache.allocator.grow(b, 2 * BLOCK)

    def sync(*ts):
        rows, pairs = tables.updates(list(ts))
        flat = tables.tables.view(-1)   # pairs index the whole flat tensor (its first 2 entries: another's)
        flat[torch.tensor(pairs[0::2], dtype=torch.long) - 2] = torch.tensor(pairs[1::2], dtype=torch.long)
        for t, row in zip(ts, rows):
            assert tables.tables[row, :len(t)].tolist() == list(t)

    sync(a, b)
    cache.allocator.truncate(a, BLOCK)
    cache.allocator.grow(b, 4 * BLOCK)   # takes a's freed blocks
    cache.allocator.grow(a, 3 * BLOCK)
    assert a.synced == 1
    sync(a, b)
    row = a.row
    tables.release(a)
    assert tables.free_rows[-1] == row and a.row is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain", "ngram", "draft", "eagle1", "eagle3"])
def test_batch_padding_changes_no_token(spec_models, tmp_path, monkeypatch, name):
    """Seeded sampling (top-p on some) and greedy requests in one batch, per-request dynamic K,
    a pool small enough to preempt: the engine's output with batches padded to buckets equals
    its output with every batch size its own bucket (no padding rows: the CPU default), token for token; the
    device tables hold the host's after every step; no block leaks; the null block stays finite."""
    args = {}
    if name != "plain":   # K 0 .. 4 per request, more for small batches (the profile's acceptance is high)
        profile = Profile([1, 4, 8], [0, 1, 4], [[1.0, 1.0, 1.0], [1.0, 1.4, 3.0], [1.0, 2.5, 20.0]],
                          [0.9] * 4)
        profile.save(str(tmp_path / "profile.json"))
        args = {**proposer_args(spec_models, name), "num_speculative_tokens": 4, "dynamic_k": True,
                "profile": str(tmp_path / "profile.json"), "per_request_k": True}
        # the profile alone prices K: step times measured on a loaded machine would move the choice
        # between the two runs (and the tokens sampled after it)
        monkeypatch.setattr(StepTimes, "observe", lambda self, *args: None)
    prompts = (PROMPTS * 3)[:19]
    params = [SamplingParams(temperature=0.8 if i % 3 else 0, top_p=0.9 if i % 2 else 1, seed=i,
                             max_tokens=24, ignore_eos=True) for i in range(len(prompts))]

    def outputs(padded: bool):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=40, max_num_seqs=19,
                  step_options=StepOptions(pad_batches=padded), **args)
        got = [o.token_ids
               for o in llm.generate(prompts, params, on_step=lambda reqs: check_tables(llm.engine))]
        for cache in (llm.engine.kv_cache, getattr(llm.engine.proposer, "kv_cache", llm.engine.kv_cache)):
            assert (cache.pool[:, :, NULL_BLOCK] == 0).all()   # tables' padding reads it; nothing writes it
        assert llm.engine.stats.preemptions > 0
        assert_no_leak(llm)
        return got, llm.engine.step_graphs.buckets

    padded, buckets = outputs(True)
    unpadded, no_padding = outputs(False)   # a CPU engine's default
    assert buckets == [1, 2, 4, 8, 16, 24] and no_padding == list(range(1, 20))
    assert padded == unpadded


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "draft", "eagle1"])
def test_an_unpadded_verify_step_equals_the_padded_one(spec_models, plain_greedy, monkeypatch, name):
    """A CPU engine's verify step (unpadded, its default) gives each row only its own num_draft + 1
    queries; the padded step (a graph's) gives every row K + 1. Same tokens, greedy (plain greedy's)
    and seeded sampled, over steps whose rows found different numbers of drafts (n-gram's misses,
    a request near its end)."""
    uneven = []
    real_body = cuda_graph.StepGraphs.verify_body

    def verify_body(self, key, width):
        if not self.padded(key.bucket) and self.step.tokens < key.bucket * (key.k + 1):
            uneven.append(self.step.tokens)
        return real_body(self, key, width)
    monkeypatch.setattr(cuda_graph.StepGraphs, "verify_body", verify_body)

    def outputs(padded: bool):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
                  num_speculative_tokens=4, step_options=StepOptions(pad_batches=padded),
                  **proposer_args(spec_models, name))
        greedy_out = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
        sampled = [o.token_ids for o in llm.generate(PROMPTS, sampled_and_greedy(len(PROMPTS)))]
        assert_no_leak(llm)
        return greedy_out, sampled

    padded, unpadded = outputs(True), outputs(False)
    assert len(uneven) >= (20 if name == "ngram" else 2)   # the unpadded step ran rows of different lengths
    assert unpadded == padded
    assert unpadded[0] == [plain_greedy[p] for p in PROMPTS]


def sampled_and_greedy(n: int) -> list[SamplingParams]:
    """Greedy requests, and seeded sampling with and without top-p, mixed in one batch."""
    return [SamplingParams(temperature=0.8 if i % 3 else 0, top_p=0.9 if i % 2 else 1, seed=i, max_tokens=24,
                           ignore_eos=True) for i in range(n)]


def processed(params: list[SamplingParams]) -> list[SamplingParams]:
    """The same requests, some of them with penalties, min_p or logprobs (a step that replays the
    forward graph and runs the rest eagerly)."""
    extras = [dict(repetition_penalty=1.3, frequency_penalty=0.2), dict(min_p=0.2), dict(logprobs=2), {}]
    return [dataclasses.replace(p, **extras[i % 4]) for i, p in enumerate(params)]


@pytest.mark.slow
@pytest.mark.parametrize("name, with_processing", [
    ("plain", False), ("ngram", False), ("draft", False), ("eagle1", False), ("eagle1_map", False),
    ("eagle3", False), ("ngram", True), ("eagle3", True), ("draft_tree", False), ("eagle1_tree", False)])
def test_graph_bodies_run_twice_equal_the_eager_step(spec_models, monkeypatch, name, with_processing):
    """Every graph body (verify, a draft round with or without its first step, the forward alone of a
    step with penalties, min_p or logprobs) run as capture and replay run it, twice on the same
    buffers at the tables' full width, gives what the eager step gives, token for token, greedy and
    sampled: nothing a body reads is left changed by its warm-up. (Before the fix, an EAGLE round
    read back its own last hidden state, and sampled drafts moved.)"""
    tree = dict(num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3) if "tree" in name \
        else {}   # EAGLE-2's trees: the parents too are compared, in the step's inputs
    args = {} if name == "plain" else {**proposer_args(spec_models, name.removesuffix("_tree")),
                                       "num_speculative_tokens": 4, **tree}
    prompts = (PROMPTS * 2)[:12]
    params = sampled_and_greedy(len(prompts))
    params = processed(params) if with_processing else params

    def outputs(rehearse: bool):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=120,
                  step_options=StepOptions(pad_batches=True, rehearse=rehearse), **args)
        steps, rounds = llm.engine.step_graphs, []
        real_run_round = steps.run_round

        def run_round(plan):   # every round's drafts and draft probabilities, as drawn
            real_run_round(plan)
            rounds.append([None if t is None else t.clone() for t in (steps.drafts, steps.draft_probs,
                                                                       steps.step.tree and steps.inputs)])
        monkeypatch.setattr(steps, "run_round", run_round)
        out = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        assert_no_leak(llm)
        return out, llm.stats["accepted_tokens"], llm.stats["drafted_tokens"], rounds

    (eager, *eager_counts, eager_rounds), (twice, *twice_counts, twice_rounds) = outputs(False), outputs(True)
    assert twice == eager and twice_counts == eager_counts
    assert name == "plain" or eager_counts[1] > 50   # drafts were made and verified
    assert len(twice_rounds) == len(eager_rounds)
    assert name in ("plain", "ngram") or eager_rounds
    for mine, theirs in zip(twice_rounds, eager_rounds):
        for a, b in zip(mine, theirs):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_draft_models_round_as_one_graph_equals_its_eager_catch_up(spec_models, monkeypatch, temperature):
    """The draft model's steady-state first step inside the round's graph (its 1 or 2 new tokens
    a row, padded to 2) drafts what the eager catch-up step drafts: the same outputs and the same
    acceptance, greedy and sampled."""
    from nanospec.proposer import DraftModelProposer
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(8)]

    def run(graphed_catch_up: int):
        monkeypatch.setattr(DraftModelProposer, "graphed_catch_up", graphed_catch_up)
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=120,
                  draft=spec_models["target"], num_speculative_tokens=3)   # a self-draft: long acceptances
        rounds = []
        real = llm.engine.step_graphs.first_draft_step
        monkeypatch.setattr(llm.engine.step_graphs, "first_draft_step",
                            lambda *a: (rounds.append(1), real(*a)))
        out = [o.token_ids for o in llm.generate(PROMPTS, params)]
        return out, llm.stats["acceptance_rate_per_position"], len(rounds)

    (eager, eager_rates, none), (graphed, graphed_rates, rounds) = run(0), run(2)
    assert none == 0 and rounds >= 5   # every decode step after the first catch-up
    assert graphed == eager and graphed_rates == eager_rates


def check_tables(engine):
    """Every running request's table on the device holds its synced ids and, past what it last
    sent, only the null block (no stale id of another sequence); the null row nothing else."""
    tables = engine.step_graphs.tables
    for req in engine.scheduler.running:
        t = req.block_table
        if t.row is not None:
            assert tables.tables[t.row, :t.synced].tolist() == t[:t.synced]
            assert (tables.tables[t.row, tables.row_len[t.row]:] == NULL_BLOCK).all()
    assert (tables.tables[tables.null_row] == NULL_BLOCK).all()


CUDA_PROPOSERS = ["plain", "ngram", "draft", "eagle1", "eagle3", "suffix", "hybrid_draft", "hybrid_eagle3"]
CUDA_TREES = {"eagle1@tree": dict(num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3),
              "draft@tree": dict(num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3),
              "suffix@tree": dict(num_speculative_tokens=8, speculative_topk=3),
              "suffix@static": dict(num_speculative_tokens=None,
                                    speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CUDA_PROPOSERS + list(CUDA_TREES))
def test_cuda_graph_replay_equals_eager(spec_models, name):
    """Graph replays give the eager steps' tokens, greedy and sampled, for every proposer and for draft
    trees (EAGLE-2's of a head and of a draft model, suffix decoding's, a static tree), whose walk under
    a graph covers any tree of K nodes (StepGraphs.tree_bounds)."""
    tree = CUDA_TREES.get(name)
    args = {} if name == "plain" else {**proposer_args(spec_models, name.split("@")[0]),
                                       "num_speculative_tokens": 4, **(tree or {})}
    if "suffix" in args:   # vLLM's rule: the priced extra tokens follow measured step times, which differ
        args["suffix_max_spec_offset"] = 0
    prompts = (PROMPTS * 3)[:19]
    outputs = {}
    for eager in (False, True):   # (24 rows at most: 6 buckets' graphs captured at start, not 11)
        llm = LLM(spec_models["target"], device="cuda", dtype="float32", num_kv_blocks=400, max_num_seqs=24,
                  enforce_eager=eager, **args)
        outputs[eager] = [[o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=t, seed=3, max_tokens=24, ignore_eos=True))] for t in (0, 0.8)]
        graphs = llm.engine.step_graphs.graphs
        if not eager:   # a tree step's verify graph (key.tree) was captured
            assert graphs and (not tree or any(key.tree for key in graphs)), list(graphs)
    assert outputs[False] == outputs[True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["plain", "ngram", "eagle3"])
def test_cuda_processed_steps_replay_the_forward_graph(spec_models, name):
    """Steps with penalties, min_p or logprobs on CUDA replay the forward as a graph (one per bucket
    and K) and run the LM head, the processing and the sampling eagerly, so that no graph keeps
    their [bucket, K + 1, vocab] logits: the same tokens and logprobs as --enforce-eager."""
    args = {} if name == "plain" else {**proposer_args(spec_models, name), "num_speculative_tokens": 4}
    prompts = (PROMPTS * 3)[:19]
    params = processed(sampled_and_greedy(len(prompts)))
    outputs = {}
    for eager in (False, True):
        llm = LLM(spec_models["target"], device="cuda", dtype="float32", num_kv_blocks=400,
                  enforce_eager=eager, **args)
        outputs[eager] = llm.generate(prompts, params)
        if not eager:
            steps = llm.engine.step_graphs
            assert any(key.body == "forward" for key in steps.graphs), list(steps.graphs)
            held = {key: [tuple(t.shape) for t in out or () if isinstance(t, torch.Tensor)]   # round: None
                    for key, (_, out) in steps.graphs.items()}
            assert not any(steps.vocab in shape for shapes in held.values() for shape in shapes), held
    asked = sum(p.logprobs is not None for p in params)
    assert sum(o.logprobs is not None for o in outputs[True]) == asked > 0
    for graphed, eager in zip(outputs[False], outputs[True]):
        assert graphed.token_ids == eager.token_ids
        assert (graphed.logprobs is None) == (eager.logprobs is None)
        assert len(graphed.logprobs or ()) == len(eager.logprobs or ())
        for got, want in zip(graphed.logprobs or (), eager.logprobs or ()):
            assert set(got) == set(want) and all(abs(got[t] - want[t]) < 1e-4 for t in want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("name", CUDA_PROPOSERS)
def test_cuda_decode_step_copies_once_each_way(spec_models, monkeypatch, name, batch):
    """On CUDA, under torch.cuda.set_sync_debug_mode("error") (any sync raises) but for the one
    read of the results: one host-to-device and one device-to-host memcpy in a decode step, a
    graph replay whose graph was captured before (a hybrid's step may capture a round graph of a
    shape its earlier steps did not use; its copies are counted all the same)."""
    args = {} if name == "plain" else {**proposer_args(spec_models, name), "num_speculative_tokens": 3}
    llm = LLM(spec_models["target"], device="cuda", dtype="float32", num_kv_blocks=400, max_num_seqs=16,
              **args)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_requests([engine.new_request(i, p, llm.encode_prompt(p), params)
                         for i, p in enumerate((PROMPTS * 4)[:batch])])
    for _ in range(3):   # prefill, the proposer's catch-up, a first decode step
        engine.step()
    past_prefill(engine)
    captured = len(engine.step_graphs.graphs)
    real_tolist = torch.Tensor.tolist

    def one_read(self):   # the mode it found, back after (a failure's repr of a tensor reads it too)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_tolist(self)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    monkeypatch.setattr(torch.Tensor, "tolist", one_read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    copies = {"HtoD": 0, "DtoH": 0}
    for event in prof.key_averages():
        for way in copies:
            if "Memcpy" in event.key and way in event.key:
                copies[way] += event.count
    assert copies == {"HtoD": 1, "DtoH": 1}
    if not name.startswith("hybrid"):   # a hybrid's round graphs follow its mix of rows: made on first use
        assert len(engine.step_graphs.graphs) == captured


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_compiled_piece_compiles_once_for_every_bucket(spec_models):
    """The fused pieces are compiled with dynamic shapes: one compile serves every bucket's graph
    (two at most: torch specializes a dimension of size 1), not one per bucket."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from nanospec import model as model_module
    torch._dynamo.reset()
    llm = LLM(spec_models["target"], device="cuda", dtype="float32", num_kv_blocks=400, max_num_seqs=40)
    for batch in (1, 2, 3, 9, 17, 40):   # buckets 1, 2, 4, 16, 24, 40
        llm.generate((PROMPTS * 8)[:batch], greedy(6))
    assert len(llm.engine.step_graphs.graphs) >= 6
    pieces = {"rms_norm": model_module.rms_norm, "add_rms_norm": model_module.add_rms_norm,
              "silu_and_mul": model_module.silu_and_mul}
    compiles = {name: len(_debug_get_cache_entry_list(piece.eager.__code__))
                for name, piece in pieces.items()}
    print("compiled variants:", compiles)
    assert all(1 <= n <= 2 for n in compiles.values()), compiles


@pytest.mark.parametrize("name", ["plain", "draft", "eagle3"])
def test_the_largest_step_runs_on_a_one_block_engine(spec_models, name):
    """On CUDA the KV cache is sized after what the largest graphed step allocates (measure.step_memory):
    that step, sampling with truncation and draft probabilities at the largest bucket and K, runs on
    padding rows of a one-block engine, touching only the sink block (0 bytes counted on CPU)."""
    from nanospec.dynamic_k import step_memory
    args = {} if name == "plain" else {**proposer_args(spec_models, name), "num_speculative_tokens": 4}
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", num_kv_blocks=1, max_num_seqs=40, **args)
    assert step_memory(llm.engine, 4 if args else 0) == 0
    assert llm.engine.step_graphs.buckets[-1] == 40 and llm.engine.kv_cache.allocator.num_free == 1


@pytest.mark.parametrize("name", ["draft", "eagle1"])
def test_a_tree_round_reads_nothing_on_the_host(spec_models, plain_greedy, monkeypatch, name):
    """EAGLE-2's later depths and rerank (StepGraphs.tree_body) are a CUDA graph's body: a read of a
    tensor's value on the host (item, tolist, int, float, bool, index: a sync on a GPU, which a capture
    refuses) raises inside it here; the trees it grows decode as plain greedy decoding."""
    body, keys = cuda_graph.StepGraphs.tree_body, []

    def on_host(*args):
        raise AssertionError("a tensor's value read on the host in a graph body")

    def guarded(self, key, width):
        keys.append(key)
        with monkeypatch.context() as patch:
            for read in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
                patch.setattr(torch.Tensor, read, on_host)
            return body(self, key, width)
    monkeypatch.setattr(cuda_graph.StepGraphs, "tree_body", guarded)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3,
              **proposer_args(spec_models, name))
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == [plain_greedy[p] for p in PROMPTS]
    assert keys and all(key.body == "tree" for key in keys)
