"""The engine's batching, preemption and stopping never change what a request gets: batched equals
one at a time, a tiny KV pool (preempting) equals an ample one, seeds reproduce, no block leaks."""
import pytest
import torch

from conftest import assert_no_leak, proposer_args
from nanospec import LLM, NanospecError, SamplingParams
from nanospec.stats import Stats

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "1234567890 numbers 3.14159 and",
           "héllo wörld, ça va?", "User: hello there!\nAssistant:", "It was the best of times. It was",
           "print(add(1, 2))", "The lazy dog"]


def greedy(max_tokens=24):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_batched_greedy_equals_one_at_a_time(tiny_llm):
    batched = tiny_llm.generate(PROMPTS, greedy())
    for prompt, out in zip(PROMPTS, batched):
        assert tiny_llm.generate([prompt], greedy())[0].token_ids == out.token_ids
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
    assert tiny_llm.stats["mean_acceptance_length"] == 1.0   # plain decoding: one token per request-step
    assert_no_leak(tiny_llm)


@pytest.mark.slow
def test_preemption_under_a_tiny_pool_changes_nothing(checkpoints):
    ample = LLM(checkpoints["qwen3"], device="cpu", kv_cache_gb=0.05)
    # 12 blocks of 4 tokens: room for about two requests at a time, so decode must preempt.
    tiny = LLM(checkpoints["qwen3"], device="cpu", kv_cache_gb=12 * 4 * 2 * 2 * 2 * 32 * 4 / 2**30,
               block_size=4, max_num_batched_tokens=16)
    assert tiny.engine.kv_cache.allocator.num_blocks == 12
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=i,
                             ignore_eos=True) for i in range(8)]
    expected = ample.generate(PROMPTS, params)
    got = tiny.generate(PROMPTS, params)
    assert tiny.stats["preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert_no_leak(tiny)


def test_chunked_prefill_equals_whole_prefill(checkpoints):
    whole = LLM(checkpoints["qwen2"], device="cpu", kv_cache_gb=0.05)
    chunked = LLM(checkpoints["qwen2"], device="cpu", kv_cache_gb=0.05, max_num_batched_tokens=3)
    long_prompt = " ".join(PROMPTS)
    assert whole.generate([long_prompt], greedy())[0].token_ids == chunked.generate([long_prompt],
                                                                                    greedy())[0].token_ids
    assert chunked.stats["prefill_steps"] > 5


def test_seeded_sampling_reproduces_and_seeds_differ(tiny_llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=42, ignore_eos=True)
    a = tiny_llm.generate(PROMPTS[:3], params)
    b = tiny_llm.generate(PROMPTS[:3], params)
    c = tiny_llm.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_tokens=16, seed=43,
                                                      ignore_eos=True))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_no_block_leaks_after_many_requests(tiny_llm):
    params = [SamplingParams(temperature=0.7, max_tokens=1 + i % 7, seed=i) for i in range(40)]
    outs = tiny_llm.generate([PROMPTS[i % 8] for i in range(40)], params)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert_no_leak(tiny_llm)


def test_a_step_with_nothing_to_do_does_nothing(tiny_llm):
    """step() on an idle engine (before any request, after all finished) returns no request and
    runs no pass: it used to index an empty running list."""
    engine = tiny_llm.engine
    assert engine.step() == []
    tiny_llm.generate(["ab"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == [] and not engine.scheduler.has_work()
    assert_no_leak(tiny_llm)


def test_eos_stops_and_is_not_in_text(tiny_llm):
    out = tiny_llm.generate([PROMPTS[0]], greedy(8))[0]
    eos = out.token_ids[3]   # pretend the 4th greedy token is an end-of-sequence token
    tiny_llm.engine.eos_ids.add(eos)
    try:
        stopped = tiny_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))[0]
    finally:
        tiny_llm.engine.eos_ids.discard(eos)
    first = out.token_ids.index(eos)
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[:first + 1]
    assert stopped.text == tiny_llm.tokenizer.decode(out.token_ids[:first])


def test_stop_string_cuts_the_text(tiny_llm):
    full = tiny_llm.generate([PROMPTS[1]], greedy(16))[0]
    stop = full.text[5:8]
    out = tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:full.text.index(stop)]


def test_bad_input_is_named(tiny_llm):
    with pytest.raises(NanospecError, match="context holds"):
        tiny_llm.generate(["word " * 600], greedy())
    with pytest.raises(NanospecError, match="top_p must be in"):
        tiny_llm.generate(["hi"], SamplingParams(top_p=0))
    with pytest.raises(NanospecError, match="max_tokens must be"):
        tiny_llm.generate(["hi"], SamplingParams(max_tokens=0))
    with pytest.raises(NanospecError, match="empty"):
        tiny_llm.generate([""], greedy())
    assert_no_leak(tiny_llm)   # a rejected batch queues nothing


def test_stats_of_two_calls_add_up_to_one_call_over_both(checkpoints):
    """Stats.add (train_eagle's per-category evaluation): counts over separate generate calls equal
    the counts of one call over all their prompts (n-gram drafts and greedy tokens do not depend on
    the batch)."""
    llm = LLM(checkpoints["llama3"], device="cpu", ngram=True, num_speculative_tokens=3, kv_cache_gb=0.05)
    prompts = [p * 3 for p in PROMPTS]   # repeated text: the n-gram proposer finds drafts
    llm.generate(prompts, greedy())
    together = llm.stats
    total = Stats()
    for part in (prompts[:3], prompts[3:]):
        llm.generate(part, greedy())
        total.add(llm.engine.stats)
    added = total.as_dict()
    assert together["accepted_tokens"] > 0
    for key in ("generated_tokens", "drafted_tokens", "accepted_tokens", "mean_acceptance_length",
                "acceptance_rate_per_position"):
        assert added[key] == together[key], key
    assert sum(n for ks in added["chosen_k"].values() for n in ks.values()) == added["steps"]
    for b, ks in added["request_k"].items():   # every request of a step of batch b counted once
        assert sum(ks.values()) == int(b) * sum(added["chosen_k"][b].values()), (b, ks)


def held_tensors(root) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from root through nanospec's objects (attributes, containers, module
    parameters and buffers), with a path naming it."""
    found, seen, todo = [], set(), [("llm", root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((path, obj))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += [(f"{path}[{i}]", x) for i, x in enumerate(obj)]
        elif isinstance(obj, dict):
            todo += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, torch.nn.Module):
            todo += [(f"{path}.{n}", t) for n, t in [*obj.named_parameters(), *obj.named_buffers()]]
            todo += [(f"{path}.{n}", v) for n, v in vars(obj).items() if not n.startswith("_")]
        elif type(obj).__module__.startswith("nanospec"):
            slots = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
            names = list(getattr(obj, "__dict__", {})) + slots
            todo += [(f"{path}.{n}", getattr(obj, n)) for n in names if hasattr(obj, n)]
    return found


@pytest.mark.parametrize("name", ["plain", "ngram", "draft", "eagle1", "eagle3"])
def test_no_tensor_the_engine_holds_requires_grad(spec_models, name):
    """After loading and generating, no parameter of the target, draft model or EAGLE head, and no
    buffer or cache of the engine, requires grad or hangs on an autograd graph: a step (and a CUDA
    graph's capture) records nothing for backward, so nothing keeps its activations alive."""
    args = {} if name == "plain" else proposer_args(spec_models, name)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.01, **args)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.8, seed=1, max_tokens=12))
    tensors = held_tensors(llm)
    assert any(path.endswith("pool") for path, _ in tensors) and len(tensors) > 30
    assert [path for path, t in tensors if t.requires_grad or t.grad_fn is not None] == []


@pytest.mark.parametrize("name", ["plain", "draft", "eagle3"])
def test_a_dropped_llm_is_freed_at_once(spec_models, name):
    """With the garbage collector off, dropping the last reference to an LLM frees its engine, KV
    caches and step buffers at once: no reference cycle holds them (a GPU's memory would otherwise
    wait for a full collection, which torch.cuda.graph no longer runs)."""
    import gc
    import weakref
    args = {} if name == "plain" else proposer_args(spec_models, name)
    gc.collect()
    gc.disable()
    try:
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.01, **args)
        llm.generate(PROMPTS[:3], greedy(8))
        engine = llm.engine
        held = [engine, engine.kv_cache.pool, engine.step_graphs, engine.step_graphs.inputs, engine.scheduler,
                getattr(engine.proposer, "kv_cache", engine.kv_cache).pool]
        refs = [weakref.ref(x) for x in held]
        del llm, engine, held
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def staggered(llm, prompts: list[list[int]], params: list[SamplingParams], mixed: int) -> list[list[int]]:
    """The requests arriving one by one, two steps apart, each after the first has begun decoding (as
    at a server); mixed: the scheduler's mixed_prefill_tokens (0: the offline schedule, prefill first)."""
    engine = llm.engine
    engine.scheduler.decode_between_prefills, engine.scheduler.mixed_prefill_tokens = mixed > 0, mixed
    reqs = [engine.new_request(i, "", ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
    engine.add_requests(reqs[:1])
    for req in reqs[1:]:
        while not reqs[0].output_ids and reqs[0].finish_reason is None:
            engine.step()
        engine.add_requests([req])
        engine.step()
        engine.step()
    engine.run_to_completion()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("mixed", [0, 8])
def test_a_request_with_nothing_to_prefill_is_served_alone_by_the_servers_schedule(checkpoints, mixed):
    """Under the server's schedule (a decode step tried first after a prefill chunk, and always with
    mixed steps), a one-token prompt, and a prompt the prefix cache holds whole (asked again), arrive
    when nothing runs: each decodes what offline generate gives it (the scheduler took such a request
    for stuck and preempted and admitted it again for ever: the server hung)."""
    llm = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              enable_prefix_caching=True)
    block = llm.engine.kv_cache.block_size
    prompts, params = [[5], list(range(3, 4 + block))], greedy(6)   # the second caches one whole block
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    engine, got = llm.engine, []
    engine.scheduler.decode_between_prefills, engine.scheduler.mixed_prefill_tokens = True, mixed
    engine.scheduler.preempt = lambda req: pytest.fail("preempted a request with room to spare")
    for i, ids in enumerate(prompts + prompts[1:]):
        engine.scheduler.last_was_prefill = True   # as after a prefill chunk whose request is gone
        req = engine.new_request(i, "", ids, params)
        engine.add_requests([req])
        engine.run_to_completion()
        got.append(req.output_ids)
    assert got == expected + expected[1:]
    assert_no_leak(llm)


@pytest.mark.parametrize("name", [None, "ngram", "suffix", "draft", "eagle1", "suffix_tree"])
def test_a_mixed_step_changes_no_output(spec_models, monkeypatch, name):
    """Prefill chunks riding in decode steps (a mixed step: the server's mixed_prefill_tokens) give
    every request, greedy or seeded, what the offline schedule gives it. Beside a tree or EAGLE they
    run in a pass of their own instead; the others ride in the verify's forward (counted)."""
    from nanospec.cuda_graph import StepGraphs
    rides, with_chunk = [], StepGraphs.with_chunk
    monkeypatch.setattr(StepGraphs, "with_chunk", lambda self, *a: rides.append(1) or with_chunk(self, *a))
    args = ({} if name is None else dict(suffix=True, speculative_topk=2) if name == "suffix_tree"
            else proposer_args(spec_models, name))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6]] + [list(range(3 + i, 40 + 7 * i)) * 2 for i in range(4)]
    params = [SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    if name == "suffix":   # its drafts depend on the others' output so far: greedy only
        params = [greedy(16) for _ in prompts]
    outs = {}
    for mixed in (0, 8):
        llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=8,
                  max_num_batched_tokens=64, **(dict(num_speculative_tokens=3, **args) if args else {}))
        outs[mixed] = staggered(llm, prompts, params, mixed)
        assert_no_leak(llm)
    assert outs[8] == outs[0]
    assert bool(rides) == (name in (None, "ngram", "suffix", "draft"))
