"""The scheduler on its own (no model): admission under max_num_seqs, prefill chunks under the
token budget, decode steps that grow blocks for the drafts, preemption of the newest request when
blocks run out, and every block back in the pool when requests finish or are removed."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec.engine import Scheduler
from nanospec.request import Request
from nanospec.sampling_params import SamplingParams
from nanospec.kv_cache import BlockAllocator


def request(index: int, prompt_len: int, max_tokens: int = 8) -> Request:
    ids = list(range(1, prompt_len + 1))
    return Request(index, "", ids, SamplingParams(max_tokens=max_tokens), 0, prompt_len + max_tokens,
                   tokens=list(ids))


def scheduler(num_blocks=16, block_size=4, max_num_seqs=4, budget=8) -> Scheduler:
    return Scheduler(BlockAllocator(num_blocks, block_size), max_num_seqs, budget)


def prefill_all(s: Scheduler) -> None:
    """Run prefill batches until no request needs one (as the engine would, caching what they send)."""
    while True:
        batch = s._schedule_prefill()
        if batch is None:
            return
        for req, n in zip(batch.requests, batch.query_lens):
            req.num_cached += n


def test_prefill_chunks_fit_the_token_budget_and_cache_all_but_the_last_token():
    s = scheduler(budget=8)
    a, b = request(0, 11), request(1, 6)
    s.waiting.extend([a, b])
    batch = s.schedule()
    assert batch.is_prefill and batch.requests == [a] and batch.query_lens == [8]   # a's 10 tokens do not fit
    a.num_cached += 8
    batch = s.schedule()
    # then a's rest, b in the room
    assert batch.requests == [a, b] and batch.query_lens == [2, 5]
    a.num_cached, b.num_cached = 10, 5
    assert not a.in_prefill and not b.in_prefill
    decode = s.schedule(lambda r: 0)
    assert not decode.is_prefill and decode.query_lens == [1, 1]


def test_admission_stops_at_max_num_seqs():
    s = scheduler(max_num_seqs=2, budget=100)
    reqs = [request(i, 5) for i in range(3)]
    s.waiting.extend(reqs)
    prefill_all(s)
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]


def test_a_one_token_prompt_skips_prefill():
    s = scheduler()
    r = request(0, 1)
    s.waiting.append(r)
    batch = s.schedule(lambda req: 3)
    assert not batch.is_prefill and batch.requests == [r] and batch.query_lens == [4]


@pytest.mark.parametrize("mixed, last_was_prefill", [(0, True), (8, False), (8, True)])
def test_a_request_with_nothing_to_prefill_decodes_when_decode_is_tried_first(mixed, last_was_prefill):
    """The server's schedule tries a decode step first (after a prefill chunk; always with mixed
    steps). A request admitted then with nothing to prefill (a one-token prompt; a prompt the prefix
    cache holds whole) decodes in that step: taken for stuck, it was preempted and admitted again,
    for ever, and the server hung."""
    s = scheduler()
    s.decode_between_prefills, s.mixed_prefill_tokens, s.last_was_prefill = True, mixed, last_was_prefill
    s.preempt = lambda req: pytest.fail("preempted a request with room to spare")
    r = request(0, 1)
    s.waiting.append(r)
    batch = s.schedule(lambda req: 2)
    assert not batch.is_prefill and batch.requests == [r] and batch.query_lens == [3]


def test_a_request_yet_to_stream_waits_for_the_prompts_still_to_prefill_between_chunks():
    """The server's schedule puts a decode step between prefill chunks for the streams already
    running. A request prefilled but yet to give a token is left out of it while prompts are still
    to prefill (a chunk after its first token would be a gap in its stream), and joins when none
    are; with mixed steps it is not held."""
    for mixed in (0, 4):
        s = scheduler(num_blocks=32, budget=8)
        s.decode_between_prefills, s.mixed_prefill_tokens = True, mixed
        streaming, fresh, arriving = request(0, 5), request(1, 5), request(2, 14)
        s.waiting.extend([streaming, fresh])
        prefill_all(s)
        streaming.num_cached, streaming.tokens = 5, streaming.tokens + [7]   # it has given a token
        s.waiting.append(arriving)
        s.last_was_prefill = True
        batch = s.schedule()
        assert not batch.is_prefill and batch.requests == ([streaming] if not mixed else [streaming, fresh])
        if mixed:
            continue
        batch = s.schedule()
        assert batch.is_prefill and batch.requests == [arriving] and batch.query_lens == [8]
        arriving.num_cached += 8
        assert s.schedule().requests == [streaming]   # arriving still has 5 tokens to prefill
        prefill_all(s)
        s.last_was_prefill = True
        assert s.schedule().requests == [streaming, fresh, arriving]


def test_decode_grows_blocks_for_the_drafts_and_preempts_the_newest_when_they_run_out():
    s = scheduler(num_blocks=5, block_size=4, budget=100)
    a, b = request(0, 7), request(1, 7)
    s.waiting.extend([a, b])
    prefill_all(s)                        # 6 cached tokens each: 2 blocks each, 1 block free
    assert s.allocator.num_free == 1
    batch = s.schedule(lambda r: 2)       # each needs 6 + 3 = 9 slots: 3 blocks, 1 more each
    assert batch.requests == [a] and s.stats.preemptions == 1
    assert list(s.waiting) == [b] and b.num_cached == 0 and b.block_table == []
    assert len(a.block_table) == 3 and s.allocator.num_free == 2


def test_remove_returns_every_block_whether_finished_running_or_waiting():
    s = scheduler(budget=100)
    reqs = [request(i, 9) for i in range(3)]
    freed = []
    s.on_free = freed.append
    s.waiting.extend(reqs)
    prefill_all(s)
    s.waiting.append(extra := request(3, 5))
    s.remove([reqs[0]])
    s.remove([reqs[1], extra])
    s.remove([reqs[1]])                   # again: nothing left to free, no error
    assert s.running == [reqs[2]] and not s.waiting
    s.remove([reqs[2], reqs[0]])          # a finished request among them holds no blocks
    assert not s.has_work() and s.allocator.num_free == s.allocator.num_blocks
    assert reqs[0] in freed and extra in freed


def simulate(s: Scheduler, batch, rng: random.Random) -> None:
    """What the engine does with a batch: prefill rows cache their chunk; a decode row verifies its
    drafts, keeps a random number of them and a bonus token, rolls its cache back to them, and
    finishes (removed) at its max_tokens; full blocks of committed tokens are published."""
    for req, n in zip(batch.requests, batch.query_lens):
        req.num_cached += n
        if not batch.is_prefill:
            req.tokens.extend([7] * rng.randint(1, n))
            req.num_cached = min(req.num_cached, len(req.tokens) - 1)
            s.allocator.truncate(req.block_table, req.num_cached)
        s.allocator.publish(req.block_table, req.tokens, req.num_cached)
        if len(req.tokens) - len(req.prompt_ids) >= req.params.max_tokens:
            s.remove([req])
    if batch.chunk:
        simulate(s, batch.chunk, rng)


@settings(max_examples=150, deadline=None)
@given(schedule=st.sampled_from([(False, 0), (True, 0), (True, 4)]), budget=st.sampled_from([4, 8, 32]),
       num_blocks=st.integers(6, 16), max_num_seqs=st.integers(1, 4), drafts=st.integers(0, 3),
       arrivals=st.lists(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.booleans()),
                                  max_size=2), min_size=1, max_size=12),
       prefix_caching=st.booleans(), seed=st.integers(0, 1000))
def test_every_schedule_serves_every_request_without_looping_or_losing_blocks(
        schedule, budget, num_blocks, max_num_seqs, drafts, arrivals, prefix_caching, seed):
    """Requests arrive between steps (some aborted at once: a client gone), offline's schedule and
    the server's (decode between prefill chunks, with and without mixed steps), a pool as small as
    one request's need, with and without prefix caching (the prompts share their beginnings: some
    are cached whole): each step is a batch within the budgets, no schedule preempts without end
    (the hang of a request admitted with nothing to prefill), no block is lost, and every request
    that stays finishes."""
    s = Scheduler(BlockAllocator(num_blocks, 4, prefix_caching=prefix_caching), max_num_seqs, budget)
    rng = random.Random(seed)
    s.decode_between_prefills, s.mixed_prefill_tokens = schedule
    preempt, calls = s.preempt, []

    def counted(req):   # more preemptions in one schedule than requests: it loops
        calls.append(req)
        assert len(calls) <= len(every), "the schedule preempts without end"
        preempt(req)
    s.preempt = counted
    every, steps = [], 0
    while s.has_work() or arrivals:
        for prompt_len, max_tokens, aborted in arrivals.pop(0) if arrivals else []:
            # a request fits the pool alone, its drafts too
            max_tokens = min(max_tokens, num_blocks * 4 - prompt_len - drafts - 1)
            every.append(r := request(len(every), prompt_len, max_tokens))
            s.waiting.append(r)
            if aborted:
                s.remove([r])
        if not s.has_work():
            continue
        calls.clear()
        batch = s.schedule(lambda req: drafts)
        rows = batch.requests + (batch.chunk.requests if batch.chunk else [])
        assert rows and all(r in s.running for r in rows)
        assert len(batch.requests) <= max_num_seqs
        if batch.is_prefill:
            assert sum(batch.query_lens) <= budget
        if batch.chunk:
            assert sum(batch.chunk.query_lens) <= s.mixed_prefill_tokens
        simulate(s, batch, rng)
        held = {b for r in s.running + list(s.waiting) for b in r.block_table}   # (shared ones once)
        assert s.allocator.num_free + len(held) == num_blocks and not any(r.block_table for r in s.waiting)
        steps += 1
        assert steps < 2000, "requests left unfinished"
    assert s.allocator.num_free == num_blocks
