"""The OpenAI-compatible server, driven by the real `openai` client on 127.0.0.1: its answers equal
offline generate / chat token for token (every proposer, greedy and seeded sampling, whole and
streamed); 32 concurrent clients with a quarter of them going away mid-stream leave no block behind;
every error is in the OpenAI shape with its status; a request whose logits are not finite fails
alone; SIGTERM under load finishes the streams and exits 0."""
import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import PROMPTS, ROOT, assert_no_leak, proposer_args
from nanospec import LLM, NanospecError, SamplingParams
from nanospec.cuda_graph import StepOptions
from nanospec.engine_loop import EngineLoop, QueueFull, TextStream, Update, held_back

# The serving pieces are optional at run time (a GPU machine may lack them): skip, not a collection error.
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanospec.serve import Server, uvicorn_server  # noqa: E402 (imports fastapi, uvicorn: after the skips)

KV = dict(device="cpu", dtype="float32", kv_cache_gb=0.02)
NAME = "tiny"


@contextlib.contextmanager
def serving(llm, **kw):
    """The server over `llm` on a free port, in a thread; yields (server, base URL)."""
    server = Server(llm, NAME, **kw)
    sock = socket.create_server(("127.0.0.1", 0))
    http = uvicorn_server(server.app(), "127.0.0.1", 0, graceful_seconds=10)
    server.loop.start()   # on a thread: the test runs on the main one
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not http.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(30)
        assert not server.loop.thread.is_alive()


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def post(url, body, headers=None):
    """(status, JSON body) of a raw POST; body: bytes as sent, or an object to send as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(url) -> dict:
    """Prometheus samples without their labels but model_name's, summed: name{other labels} -> value."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            labels = ",".join(x for x in re.findall(r'\w+="[^"]*"', name) if not x.startswith("model_name="))
            out[name.split("{")[0] + (f"{{{labels}}}" if labels else "")] = float(value)
    return out


GREEDY = dict(temperature=0, max_tokens=16)
SEEDED = dict(temperature=0.8, top_p=0.9, max_tokens=16)
CONVERSATIONS = [[{"role": "user", "content": "hello there!"}],
                 [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "1234567890 numbers"},
                  {"role": "assistant", "content": "It was"},
                  {"role": "user", "content": "The quick brown fox"}]]


def params(kw, seed=None):
    return SamplingParams(**kw, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["plain", "ngram", "draft", "eagle1", "eagle3"])
def test_answers_equal_offline_generate_and_chat(spec_models, proposer):
    spec_args = {} if proposer == "plain" else proposer_args(spec_models, proposer)
    llm = LLM(spec_models["target"], **KV, **spec_args)
    prompts = PROMPTS[:4]
    greedy = [o.text for o in llm.generate(prompts, params(GREEDY))]
    seeded = llm.generate(prompts, [params(SEEDED, seed=i) for i in range(len(prompts))])
    chats = [llm.chat(c, params(GREEDY))[0] for c in CONVERSATIONS]
    with serving(llm) as (server, url):
        api = client(url)
        for i, prompt in enumerate(prompts):
            out = api.completions.create(model=NAME, prompt=prompt, **GREEDY)
            assert out.choices[0].text == greedy[i]
            sampled = api.completions.create(model=NAME, prompt=prompt, seed=i, **SEEDED)
            assert sampled.choices[0].text == seeded[i].text
            assert sampled.usage.completion_tokens == len(seeded[i].token_ids)
            assert sampled.usage.prompt_tokens == len(seeded[i].prompt_token_ids)
            stream = api.completions.create(model=NAME, prompt=prompt, seed=i, stream=True,
                                            stream_options={"include_usage": True}, **SEEDED)
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == seeded[i].text
            assert chunks[-1].usage.completion_tokens == len(seeded[i].token_ids)
            assert chunks[-2].choices[0].finish_reason == seeded[i].finish_reason
        for conversation, expected in zip(CONVERSATIONS, chats):
            out = api.chat.completions.create(model=NAME, messages=conversation, **GREEDY)
            assert out.choices[0].message.content == expected.text
            assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
            stream = api.chat.completions.create(model=NAME, messages=conversation, stream=True, **GREEDY)
            assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text
        if proposer != "plain":   # the request's own figures ride in usage
            speculation = out.usage.model_extra["speculation"]
            assert (speculation["draft_tokens"] >= speculation["accepted_tokens"] >= 0
                    and speculation["draft_steps"] > 0)
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def ngram_llm(spec_models):
    return LLM(spec_models["target"], ngram=True, **KV)


def mixed_params(i: int) -> SamplingParams:
    """Request i of 32: greedy or sampled (top-p, top-k), its own seed, length and K (0..4)."""
    sampled = i % 3 != 0
    return SamplingParams(temperature=0.7 if sampled else 0, top_p=0.9 if i % 2 else 1.0,
                          top_k=20 if i % 4 == 1 else 0, seed=1000 + i, max_tokens=8 + i % 9,
                          num_speculative_tokens=i % 5, ignore_eos=True)


@pytest.mark.slow
def test_32_concurrent_clients_a_quarter_of_them_leaving(ngram_llm):
    """Every staying request gets its offline answer; the ones that leave mid-stream are aborted
    with every block of theirs; the server answers afterwards."""
    llm = ngram_llm
    n = 32
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    expected = [o.text for o in llm.generate(prompts, [mixed_params(i) for i in range(n)])]
    leaving = set(range(0, n, 4))
    got, errors = {}, []
    with serving(llm) as (server, url):
        def one(i):
            try:
                p = mixed_params(i)
                extra = {"top_k": p.top_k, "ignore_eos": True,
                         "num_speculative_tokens": p.num_speculative_tokens}
                if i in leaving:   # a long answer, dropped after two chunks
                    stream = client(url).completions.create(model=NAME, prompt=prompts[i], max_tokens=400,
                                                            temperature=0.7, seed=i, stream=True,
                                                            extra_body=extra)
                    for k, _ in enumerate(stream):
                        if k == 1:
                            break
                    stream.close()
                    return
                stream = client(url).completions.create(model=NAME, prompt=prompts[i],
                                                        max_tokens=p.max_tokens, temperature=p.temperature,
                                                        top_p=p.top_p, seed=p.seed, stream=True,
                                                        extra_body=extra)
                got[i] = "".join(c.choices[0].text for c in stream)
            except Exception as e:   # reported below, with the request's number
                errors.append((i, repr(e)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        assert got == {i: expected[i] for i in range(n) if i not in leaving}
        deadline = time.time() + 30
        while time.time() < deadline:   # the aborts land at the next step
            m = metrics(url)
            if m["nanospec:num_requests_running"] == 0 and m["nanospec:num_requests_waiting"] == 0:
                break
            time.sleep(0.1)
        assert (m['nanospec:kv_cache_free_blocks{pool="target"}']
                == m['nanospec:kv_cache_blocks{pool="target"}'])
        assert m['nanospec:request_success_total{finished_reason="abort"}'] == len(leaving)
        assert m['nanospec:request_success_total{finished_reason="length"}'] == n - len(leaving)
        assert (m["nanospec:spec_decode_num_draft_tokens_total"]
                >= m["nanospec:spec_decode_num_accepted_tokens_total"])
        # the prompts repeat, and the offline run cached them: answers as above with prefixes found cached
        assert m["nanospec:prefix_cache_queries_total"] >= m["nanospec:prefix_cache_hits_total"] > 0
        last = client(url).completions.create(model=NAME, prompt="The", max_tokens=4)
        assert last.choices[0].text is not None
    assert_no_leak(llm)


def error(status_body):
    status, body = status_body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return status, body["error"]


@pytest.mark.parametrize("body, status, message", [
    (b"{bad", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "x", "foo": 1}, 400, "unknown field foo"),
    ({"prompt": "x", "n": 0}, 400, "n must be an integer in 1..1024"),
    ({"prompt": "x", "n": "2"}, 400, "n must be an integer in 1..1024"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of=2 is not supported"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs must be an integer in 0..20"),
    # completions' is a count
    ({"prompt": "x", "logprobs": True}, 400, "logprobs must be an integer in 0..20"),
    ({"prompt": "x", "echo": True}, 400, "echo=true is not supported"),
    # a lone surrogate (valid JSON): a 400 for this request alone
    ({"prompt": "x", "stop": ["\ud800"]}, 400, "not valid text"),
    # ... quoted, escaped, in the message of an OpenAI-shaped 400
    ({"prompt": "x", "\ud800": 1}, 400, "unknown field \\ud800"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens must be an integer >= 1"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature must be a finite number"),
    # JSON's 1e400 as an integer: an OpenAI-shaped 400, not a plain-text 500
    ({"prompt": "x", "top_p": 10**400}, 400, "top_p must be in"),
    ({"prompt": "x", "stop": [""]}, 400, "stop holds an empty string"),
    ({"prompt": "x", "stop": 5}, 400, "stop must be a string or a list of strings"),
    ({"prompt": "x", "num_speculative_tokens": 2}, 400, "has no proposer"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    ({"prompt": "x", "stop_token_ids": [-3]}, 400,
     "stop_token_ids must hold token ids (integers >= 0), got -3"),
    ({"prompt": "x", "stop_token_ids": [None]}, 400,
     "stop_token_ids must hold token ids (integers >= 0), got None"),
    ({"prompt": "x", "stop_token_ids": [10**40]}, 400, f"stop_token_ids holds {10**40}, outside"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty must be a finite number in [-2, 2]"),
    ({"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty must be a finite number in [0.01, 100]"),
    ({"prompt": "x", "repetition_penalty": 1e-40}, 400,
     "repetition_penalty must be a finite number in [0.01, 100]"),
    ({"prompt": "x", "include_stop_str_in_output": "yes"}, 400,
     "include_stop_str_in_output must be true or false"),
    ({"prompt": "x", "skip_special_tokens": 1}, 400, "skip_special_tokens must be true or false"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "only for streamed requests"),
    ({"prompt": ["a", 5]}, 400, "prompt must be a string, a list of token ids, or a list of either"),
    ({"prompt": []}, 400, "prompt must be a string, a list of token ids, or a list of either"),
    ({"prompt": ["a"] * 600, "n": 2}, 400, "600 prompts x n = 2 are more requests than may wait"),
    ({"prompt": "a", "n": 3, "seed": 2**63 - 2}, 400, "with n = 3, seed may be at most 2**63 - 3"),
    ({"prompt": ["hello", ""]}, 400, "prompt 1 is empty"),   # its place in the list
    ({"prompt": [999999]}, 400, "outside this model and tokenizer's ids"),
    ({"prompt": "x " * 600}, 400, "the context holds"),
    ({"prompt": "x", "model": "gpt-4"}, 404, 'the model "gpt-4" is not served here'),
    # the body's own limits: one place (serve.read_body), each a 400 that names the problem
    (b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}", 400, "not valid JSON (an integer of 5000 digits)"),
    (b'{"prompt": "x", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    (b'{"prompt": "x", "stop": ' + b"[" * 20 + b"]" * 20 + b"}", 400, "nested more than 16 deep"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "not valid JSON (NaN is not a JSON number)"),
    # a refused value is quoted shortened
    ({"prompt": "x", "n": 10**4000}, 400, "n must be an integer in 1..1024 (the server's --max-queue), got "
     + "1" + "0" * 76 + "..."),
    ({"prompt": "x", "model": "m" * 10**5}, 404, '"' + "m" * 76 + '... is not served here'),
    # as vLLM: max_tokens must fit in what the context leaves after the prompt
    ({"prompt": "x", "max_tokens": 10**5}, 400, "max_tokens 100000 is more than the context leaves: prompt 0 "
     "has 1 tokens of the 512 the model holds, so at most 511 may follow; lower max_tokens"),
])
def test_errors_are_in_the_openai_shape(tiny_served, body, status, message):
    url, key = tiny_served
    got_status, err = error(post(url + "/v1/completions", body, {"Authorization": f"Bearer {key}"}))
    assert got_status == status and message in err["message"]


def test_a_body_not_sent_as_json_is_refused(tiny_served):
    url, key = tiny_served
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        status, err = error(post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                 {"Authorization": f"Bearer {key}", "Content-Type": content_type}))
        assert status == 400 and "must be sent as JSON: set the header 'Content-Type: application/json'" \
            in err["message"]
    status, _ = post(url + "/v1/completions", {"prompt": "x", "max_tokens": 2},
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_chat_errors_and_unsupported_fields(tiny_served):
    url, key = tiny_served
    auth = {"Authorization": f"Bearer {key}"}
    hi = [{"role": "user", "content": "x"}]
    for body, message in [({"messages": hi, "top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                          ({"messages": hi, "logprobs": True, "top_logprobs": 21},
                           "top_logprobs must be an integer in 0..20"),
                          ({"messages": hi, "logprobs": 1}, "logprobs must be true or false"),
                          ({"messages": "hi"}, "messages"),
                          ({"messages": [{"role": "user"}], "tools": [{}]}, "tools"),
                          ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                            "max_completion_tokens": 4}, "not both")]:
        status, err = error(post(url + "/v1/chat/completions", body, auth))
        assert status == 400 and message in err["message"]


def test_api_key_unknown_routes_and_a_full_queue(tiny_served, monkeypatch):
    url, key = tiny_served
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, err = error(post(url + "/v1/completions", {"prompt": "x"}, headers))
        assert status == 401 and err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").models.list()
    assert [m.id for m in client(url, key).models.list()] == [NAME]
    assert urllib.request.urlopen(url + "/health").status == 200
    status, err = error(post(url + "/v1/nothing", {}))
    assert status == 404
    with pytest.raises(openai.APIStatusError) as e:
        client(url, key).completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"best_of": 3})
    assert e.value.status_code == 400


def test_a_full_queue_is_503_with_retry_after(tiny_llm):
    with serving(tiny_llm) as (server, url):
        server.loop.max_waiting = 0
        request = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert "already do; retry later" in json.loads(e.value.read())["error"]["message"]
        server.loop.max_waiting = 10
        assert client(url).completions.create(model=NAME, prompt="x", max_tokens=2).choices


@pytest.fixture(scope="module")
def tiny_served(spec_models):
    llm = LLM(spec_models["target"], **KV, max_model_len=512)
    with serving(llm, api_key="sekret") as (server, url):
        yield url, "sekret"


def test_the_loop_counts_its_waiting_requests(tiny_llm):
    loop = EngineLoop(tiny_llm.engine, max_waiting=1)   # not started: nothing leaves the inbox
    make = lambda: tiny_llm.engine.new_request(0, "", [5, 6], SamplingParams(max_tokens=2))
    loop.submit([(make(), print)])
    with pytest.raises(QueueFull, match="1 requests may wait and 1 already do"):
        loop.submit([(make(), print)])
    loop = EngineLoop(tiny_llm.engine, max_waiting=2)
    with pytest.raises(QueueFull, match="2 requests may wait and 0 already do"):   # n choices: all or none
        loop.submit([(make(), print) for _ in range(3)])
    assert loop.num_waiting() == 0


def test_a_cut_stops_the_loop_at_once_and_frees_what_it_held(spec_models, monkeypatch):
    """stop(cut=True), what the server calls once its HTTP side has ended: the requests the loop holds
    or was handed are aborted at the next step and the loop ends, its blocks all free (plain stop()
    finishes them first; a cut request's listener, which no response is left to hear, gets no finish)."""
    llm = LLM(spec_models["target"], **KV)
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.02), step())[1])   # 480 steps: ~10 s
    loop, updates = EngineLoop(llm.engine).start(), []
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    loop.submit([(llm.engine.new_request(i, "", [5, 6, 7], params), updates.append) for i in range(2)])
    deadline = time.time() + 30
    while len(updates) < 4 and time.time() < deadline:
        time.sleep(0.01)
    loop.stop(timeout=5, cut=True)
    assert not loop.thread.is_alive() and not llm.engine.scheduler.has_work() and not loop.tracked
    assert len(updates) < 100 and all(u.finish_reason is None for u in updates)
    assert_no_leak(llm)


def test_a_failed_stream_ends_with_its_error_and_done_without_usage(spec_models, monkeypatch):
    """A step that fails midway: a streamed request (n = 1 and n = 2) gets the error, then [DONE];
    no usage chunk, though it asked for one (as vLLM ends such a stream)."""
    llm = LLM(spec_models["target"], **KV)
    real_step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) % 3 == 0:
            raise RuntimeError("boom")
        return real_step()
    monkeypatch.setattr(llm.engine, "step", failing_step)
    with serving(llm) as (_, url):
        for n in (1, 2):
            body = {"prompt": "a", "n": n, "max_tokens": 50, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"]
            assert not any('"usage"' in e for e in events)


def test_a_step_that_raises_midway_fails_what_the_loop_holds_and_leaves_no_kv(spec_models, monkeypatch):
    """The server's loop catches a step that raised after layer 0 wrote NaN K/V (the reference
    attention, as on CUDA, writes layer by layer): its requests fail with the error, the pool is
    left as a fresh one (no NaN in blocks a later request may read masked), the next request is served."""
    llm = LLM(spec_models["target"], step_options=StepOptions(pad_batches=True, kv_mirror=False), **KV)
    expected = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[200] = float("nan")
    mlp = llm.model.model.layers[0].mlp
    monkeypatch.setattr(mlp, "forward", lambda x: 1 / 0)
    loop, updates = EngineLoop(llm.engine), []

    def serve_one(prompt_ids):   # what loop() does with one arrival, then one step
        loop.submit([(llm.engine.new_request(0, "", prompt_ids, SamplingParams(temperature=0, max_tokens=4)),
                      updates.append)])
        t = loop.inbox.popleft()
        loop.tracked[id(t.req)] = t
        llm.engine.add_requests([t.req])
        while id(t.req) in loop.tracked:
            loop.step()
        return t.req
    failed = serve_one([200] + list(range(10, 40)))
    assert failed.finish_reason == "error" and "ZeroDivisionError" in failed.error
    assert torch.isfinite(llm.engine.kv_cache.pool).all()
    monkeypatch.delattr(mlp, "forward")
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[200] = 0.0
    assert serve_one([5, 6, 7, 8]).output_ids == expected
    assert_no_leak(llm)


def test_the_metrics_count_the_servers_work_only(spec_models):
    """What the LLM generated offline before the server was built is not the server's: /metrics counts
    from zero (it had counted the earlier run's tokens and drafts on its first step)."""
    llm = LLM(spec_models["target"], draft=spec_models["target"], num_speculative_tokens=3, **KV)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    with serving(llm) as (_, url):
        client(url).completions.create(model=NAME, prompt="The", max_tokens=9, temperature=0,
                                       extra_body={"ignore_eos": True})
        m = metrics(url)
    assert m["nanospec:generation_tokens_total"] == 9
    assert 0 < m["nanospec:spec_decode_num_draft_tokens_total"] <= 3 * 9


def test_a_whole_request_whose_client_leaves_is_aborted_while_tokens_come(spec_models, monkeypatch):
    """A non-streamed request whose client closes its connection is aborted within a few seconds,
    however fast the steps deliver (the disconnect was checked only when no update came for a second)."""
    llm = LLM(spec_models["target"], **KV)
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (time.sleep(0.02), step())[1])   # 480 steps: ~10 s
    with serving(llm) as (server, url):
        body = json.dumps({"prompt": "The quick", "max_tokens": 480, "temperature": 0,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as conn:
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.5)
        deadline = time.time() + 30
        while metrics(url)['nanospec:num_requests_running'] and time.time() < deadline:
            time.sleep(0.1)
        m = metrics(url)
        assert m['nanospec:request_success_total{finished_reason="abort"}'] == 1
        assert m["nanospec:generation_tokens_total"] < 300
    assert_no_leak(llm)


def test_a_request_with_non_finite_logits_fails_alone(spec_models):
    """A prompt holding a token whose embedding is NaN fails with a 500 naming the cause; requests
    in the same batch get their offline answers (their caches recomputed) and the server goes on."""
    llm = LLM(spec_models["target"], **KV)
    prompts = PROMPTS[:3]
    expected = llm.generate(prompts, params(GREEDY))
    used = {t for o in expected for t in o.prompt_token_ids + o.token_ids}
    bad = next(t for t in range(3, 300) if t not in used)
    with torch.no_grad():
        llm.model.model.embed_tokens.weight[bad] = float("nan")
    results = {}
    with serving(llm) as (server, url):
        def one(key, prompt):
            results[key] = post(url + "/v1/completions", {"prompt": prompt, **GREEDY})
        threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
        threads.append(threading.Thread(target=one, args=("bad", [5, bad, 7])))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        status, err = error(results.pop("bad"))
        assert status == 500 and "produced NaN or infinite K/V" in err["message"]   # found by its prefill
        assert ({i: r[1]["choices"][0]["text"] for i, r in results.items()}
                == {i: o.text for i, o in enumerate(expected)})
        _, after = post(url + "/v1/completions", {"prompt": prompts[0], **GREEDY})
        assert after["choices"][0]["text"] == expected[0].text
    assert_no_leak(llm)


def test_sampling_defaults_are_the_checkpoints_generation_config(checkpoints, tmp_path):
    """A request that leaves temperature, top_p, top_k, min_p and the penalties out (and chat's
    max_tokens) samples with the values of the checkpoint's generation_config.json, as vLLM's
    --generation-config auto does, read here by transformers' GenerationConfig; the request's own
    values come first, and generation_config="vllm" gives the neutral ones. LLM.generate without
    params takes them too."""
    from transformers import GenerationConfig
    folder = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 5, "max_new_tokens": 6,
         "repetition_penalty": 1.3, "min_p": 0.1, "eos_token_id": 256}))
    hf = GenerationConfig.from_pretrained(folder).to_diff_dict()
    from_file = dict(temperature=hf["temperature"], top_p=hf["top_p"], top_k=hf["top_k"], min_p=hf["min_p"],
                     repetition_penalty=hf["repetition_penalty"])
    neutral = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    chat = {"messages": [{"role": "user", "content": "hi"}], "seed": 3, "ignore_eos": True}

    def answer(url, **fields) -> tuple[str, int]:
        reply = post(url + "/v1/chat/completions", {**chat, **fields})[1]
        return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

    llm = LLM(str(folder), **KV)
    assert llm.get_default_sampling_params() == SamplingParams(**from_file, max_tokens=hf["max_new_tokens"])
    assert llm.sampling_defaults_read == ["temperature=0.7", "top_p=0.8", "top_k=5", "min_p=0.1",
                                          "max_new_tokens=6", "repetition_penalty=1.3"]
    with serving(llm) as (_, url):
        by_default = answer(url)
        assert by_default == answer(url, **from_file, max_tokens=hf["max_new_tokens"])
        assert by_default[1] == hf["max_new_tokens"]
        assert by_default != answer(url, **neutral, max_tokens=hf["max_new_tokens"])
        # the request's own values come first
        assert by_default != answer(url, temperature=0, max_tokens=hf["max_new_tokens"])
    llm = LLM(str(folder), **KV, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    with serving(llm) as (_, url):
        assert answer(url, max_tokens=6) == answer(url, **neutral, max_tokens=6)
    with pytest.raises(NanospecError, match="generation_config must be auto .* or vllm"):
        LLM(str(folder), **KV, generation_config="file")


@pytest.mark.slow
def test_a_chat_streams_role_chunk_comes_with_the_first_token_not_before(tiny_llm, monkeypatch):
    """As vLLM sends it: a client (vLLM's bench serve too) takes the first chunk for the first token,
    so a role chunk sent before the prefill would hide the prefill from TTFT and show it as a gap
    between tokens."""
    release, step = threading.Event(), tiny_llm.engine.step
    monkeypatch.setattr(tiny_llm.engine, "step", lambda: (release.wait(60), step())[1])
    with serving(tiny_llm) as (server, url):
        conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}),
            {"Content-Type": "application/json"})
        released = []
        threading.Timer(1.0, lambda: (released.append(time.monotonic()), release.set())).start()
        response = conn.getresponse()
        assert response.status == 200
        first = response.readline()   # blocks until the first event
        assert released and time.monotonic() >= released[0], "an event came before any step ran"
        events = [json.loads(line[6:]) for line in (first + response.read()).decode().splitlines()
                  if line.startswith("data: {")]
        conn.close()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:])


def test_special_tokens_left_out_of_the_text_whole_and_streamed(tiny_llm):
    """The server's text, whole and streamed, is offline generate's: special tokens left out by
    default (vLLM's skip_special_tokens), kept with skip_special_tokens false. A step whose token
    adds no text still sends its chunk, as vLLM does (a client times each chunk as a token: one
    left out shows as a gap of two steps): one chunk a token, plain decoding making one a step."""
    for seed in range(20):   # a sample with special tokens among the others
        sampled = dict(temperature=1.0, max_tokens=120, ignore_eos=True, seed=seed)
        offline = {skip: tiny_llm.generate("a", SamplingParams(**sampled, skip_special_tokens=skip))[0]
                   for skip in (True, False)}
        if len(offline[False].text) > len(offline[True].text):
            break
    assert len(offline[False].text) > len(offline[True].text)
    with serving(tiny_llm) as (_, url):
        api = client(url)
        for skip, expected in offline.items():
            fields = dict(temperature=1.0, max_tokens=120, seed=seed,
                          extra_body={"ignore_eos": True, **({} if skip else {"skip_special_tokens": False})})
            out = api.completions.create(model=NAME, prompt="a", **fields)
            assert out.choices[0].text == expected.text
            chunks = [c for c in api.completions.create(model=NAME, prompt="a", stream=True, **fields)
                      if c.choices]
            assert "".join(c.choices[0].text for c in chunks) == expected.text
            assert len(chunks) == len(expected.token_ids) == out.usage.completion_tokens


def test_logprobs_whole_and_streamed_are_offline_generates_in_the_openai_shape(tiny_llm):
    """Completions' logprobs = N and chat's logprobs / top_logprobs, whole and streamed, give each
    output token's logprob and the most likely tokens' as offline generate computes them (which
    tests/test_logprobs.py holds to transformers), in the OpenAI client's types. The random model
    splits characters across tokens: a token is the text it adds (joined: the output's text, special
    tokens kept), its bytes its own (joined: the output's bytes)."""
    sampled = dict(temperature=0.9, max_tokens=12, seed=4)
    messages = [{"role": "user", "content": "hi"}]
    tok = tiny_llm.tokenizer
    offline = tiny_llm.generate("a", SamplingParams(**sampled, ignore_eos=True, logprobs=3))[0]
    chat = tiny_llm.chat(messages, SamplingParams(**sampled, logprobs=2))[0]
    assert tok.decode(offline.token_ids).count("\ufffd") >= 2   # it does split characters
    with serving(tiny_llm) as (_, url):
        api = client(url)
        whole = api.completions.create(model=NAME, prompt="a", logprobs=3, extra_body={"ignore_eos": True},
                                       **sampled)
        streamed = list(api.completions.create(model=NAME, prompt="a", logprobs=3, stream=True,
                                               extra_body={"ignore_eos": True}, **sampled))
        parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
        joined = type(parts[0])(**{k: sum((getattr(p, k) for p in parts), []) for k in
                                   ("tokens", "token_logprobs", "top_logprobs", "text_offset")})
        for logprobs in (whole.choices[0].logprobs, joined):
            assert "".join(logprobs.tokens) == tok.output_text(offline.token_ids, skip_special=False)
            chosen = [e[t] for t, e in zip(offline.token_ids, offline.logprobs)]
            assert logprobs.token_logprobs == pytest.approx(chosen)
            # texts may coincide: "" for a part
            for top, entry in zip(logprobs.top_logprobs, offline.logprobs):
                assert (all(any(v == pytest.approx(w) for w in entry.values()) for v in top.values())
                        and len(top) <= 4)
            assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i]))
                                            for i in range(len(logprobs.tokens))]
        got = api.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=2,
                                          **sampled)
        stream = api.chat.completions.create(model=NAME, messages=messages, logprobs=True, top_logprobs=2,
                                             stream=True, **sampled)
        streamed = [item for c in stream if c.choices and c.choices[0].logprobs
                    for item in c.choices[0].logprobs.content]
        for content in (got.choices[0].logprobs.content, streamed):
            assert b"".join(bytes(c.bytes) for c in content) == tok.decode_bytes(chat.token_ids)
            assert "".join(c.token for c in content) == tok.output_text(chat.token_ids, skip_special=False)
            for c, t, e in zip(content, chat.token_ids, chat.logprobs):
                assert c.logprob == pytest.approx(e[t])
                top = sorted(e.items(), key=lambda item: -item[1])[:2]   # the 2 most likely, by logprob
                assert [(bytes(x.bytes), x.logprob) for x in c.top_logprobs] == \
                    [(tok.decode_bytes([u]), pytest.approx(v)) for u, v in top]
        plain = api.chat.completions.create(model=NAME, messages=messages, **sampled)
        assert plain.choices[0].logprobs is None


@pytest.mark.slow
def test_n_choices_are_n_requests_seeded_seed_plus_i(spec_models):
    """n choices, whole and streamed, completions and chat, with a proposer: choice i is offline
    generate's with seed + i (vLLM's rule), usage counts the prompt once and every choice's tokens;
    a batch of prompts gives prompt p's i-th as choice p * n + i; a client that leaves a stream of n
    choices midway leaves no request behind."""
    llm = LLM(spec_models["target"], ngram=True, **KV)
    unseeded = dict(temperature=0.8, max_tokens=10)
    sampled = dict(unseeded, seed=7)
    offline = llm.generate([PROMPTS[0]] * 3, [params(unseeded, seed=7 + i) for i in range(3)])
    chats = [llm.chat(CONVERSATIONS[0], params(unseeded, seed=7 + i))[0] for i in range(3)]
    expected = llm.generate([PROMPTS[0]] * 2 + [PROMPTS[2]] * 2,
                            [params(unseeded, seed=7 + i % 2) for i in range(4)])
    with serving(llm) as (_, url):
        api = client(url)
        whole = api.completions.create(model=NAME, prompt=PROMPTS[0], n=3, **sampled)
        assert [c.index for c in whole.choices] == [0, 1, 2]
        assert [c.text for c in whole.choices] == [o.text for o in offline]
        assert len({c.text for c in whole.choices}) > 1   # seeded apart
        assert whole.usage.prompt_tokens == len(offline[0].prompt_token_ids)
        assert whole.usage.completion_tokens == sum(len(o.token_ids) for o in offline)
        stream = api.chat.completions.create(model=NAME, messages=CONVERSATIONS[0], n=3, stream=True,
                                             stream_options={"include_usage": True}, **sampled)
        texts, finished = ["", "", ""], [None] * 3
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finished[c.index] = c.finish_reason or finished[c.index]
        assert texts == [o.text for o in chats] and finished == [o.finish_reason for o in chats]
        assert chunk.usage.completion_tokens == sum(len(o.token_ids) for o in chats)
        greedy = api.completions.create(model=NAME, prompt=PROMPTS[1], n=2, temperature=0, max_tokens=6)
        assert greedy.choices[0].text == greedy.choices[1].text
        batch = api.completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[2]], n=2, **sampled)
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [o.text for o in expected]
        assert batch.usage.prompt_tokens == (len(expected[0].prompt_token_ids)
                                             + len(expected[2].prompt_token_ids))
        long = api.completions.create(model=NAME, prompt=PROMPTS[0], n=4, stream=True, max_tokens=200,
                                      extra_body={"ignore_eos": True})
        next(iter(long))
        long.close()   # the client leaves: all four are aborted
        deadline = time.time() + 30
        while llm.engine.scheduler.has_work() and time.time() < deadline:
            time.sleep(0.05)
    assert_no_leak(llm)


def test_vllms_stop_fields_and_the_penalties_reach_the_request():
    from nanospec.serve import sampling_params
    got = sampling_params({"stop_token_ids": [5, 9], "include_stop_str_in_output": True,
                           "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2},
                          16, {})
    assert got.stop_token_ids == [5, 9] and got.include_stop_str_in_output
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0.5, -1, 1.2)
    assert sampling_params({"stop_token_ids": None}, 16, {}).stop_token_ids == []


def test_text_stream_holds_back_a_possible_stop_and_split_characters(tiny_llm):
    """Token by token, what a client has seen is always a start of the final text (no character
    sent in halves, nothing of the stop sent), and the deltas add up to it."""
    tok = tiny_llm.tokenizer
    assert held_back("abc xy", ["xyz"]) == 2 and held_back("abc", ["xyz"]) == 0
    final = "héllo wörld, "
    ids = tok.encode(final + "stop here")
    # where the engine would stop
    end = next(n for n in range(len(ids)) if "stop" in tok.decode(ids[:n + 1]))
    stream, seen = TextStream(tok, ["stop"]), ""
    for t in ids[:end]:
        seen += stream.push(Update([t]))
        assert final.startswith(seen)
    assert seen + stream.push(Update([ids[end]], "stop", final)) == final


@pytest.mark.slow
def test_text_stream_decodes_each_token_once_and_matches_a_whole_decode():
    """Random bytes (split characters, invalid UTF-8, U+FFFD itself), pushed one to three tokens at
    a time: what was sent is always a start of the whole decode of the tokens so far, what is held
    is at most a split character's bytes or a stop's start, the deltas add up to the final text, and
    every token's bytes are decoded once (the whole output re-decoded per update was quadratic)."""
    from nanospec.tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    decoded = []
    tok.decode_bytes = (lambda ids, skip=False, whole=tok.decode_bytes:
                        decoded.append(len(ids)) or whole(ids, skip))
    rng = random.Random(0)
    pieces = ["é".encode(), "€".encode(), "😀".encode(), b"\xff", b"\xe2\x82", b"\xef\xbf\xbd",
              b"ab", b"st", b"op"]
    for trial in range(200):
        ids = list(b"".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30))))
        stops = rng.choice([[], ["stop"], ["\ufffd"], ["é€"]])
        stream, sent, decoded[:] = TextStream(tok, stops), "", []
        i = 0
        while i < len(ids):
            n = rng.randint(1, 3)
            sent += stream.push(Update(ids[i:i + n]))
            i += n
            whole = bytes(ids[:i]).decode("utf-8", errors="replace")
            assert whole.startswith(sent)
            if held_back(whole, stops) == 0 and not ends_in_a_split_character(bytes(ids[:i])):
                assert sent == whole   # nothing held that need not be
        final = bytes(ids).decode("utf-8", errors="replace")
        assert sent + stream.push(Update([], "length", final)) == final
        assert sum(decoded) == len(ids)


def ends_in_a_split_character(data: bytes) -> bool:
    """Whether the last 1-3 bytes start a UTF-8 character that more bytes could complete."""
    return any(one_character(data[-n:] + bytes([c]) + b"\x80" * (more - 1))
               for n in (1, 2, 3) if len(data) >= n for more in range(1, 5 - n) for c in range(0x80, 0xC0))


def one_character(data: bytes) -> bool:
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def test_decode_steps_run_between_the_chunks_of_a_long_prompt(spec_models):
    """With decode_between_prefills (the server's setting), a request already decoding gets a step
    between every two prefill chunks of a long prompt; offline, all chunks go first."""
    for between, expect_gaps in ((True, True), (False, False)):
        llm = LLM(spec_models["target"], **KV, max_num_batched_tokens=32)
        llm.engine.scheduler.decode_between_prefills = between
        engine = llm.engine
        short = engine.new_request(0, "", [5, 6, 7],
                                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.add_requests([short])
        while not short.output_ids:
            engine.step()
        long = engine.new_request(1, "", list(range(3, 200)), SamplingParams(temperature=0, max_tokens=2))
        engine.add_requests([long])
        kinds = []
        while long.in_prefill or long.num_cached == 0:
            before = len(short.output_ids)
            engine.step()
            kinds.append("decode" if len(short.output_ids) > before else "prefill")
        chunks = kinds.count("prefill")
        assert chunks >= 6
        assert (kinds.count("decode") >= chunks - 1) == expect_gaps
        engine.abort([short, long])


@contextlib.contextmanager
def server_process(target: str):
    """`python -m nanospec.serve` over `target` in a process of its own, on one thread: yields (the
    process, its base URL) once it answers /health; killed at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nanospec.serve", "--target", target, "--device", "cpu",
                             "--port", str(port), "--threads", "1"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        yield proc, url
    finally:
        proc.kill()


@pytest.mark.slow
def test_sigterm_under_load_finishes_the_streams_and_exits_0(spec_models):
    with server_process(spec_models["target"]) as (proc, url):
        outs = {}

        def one(i):
            stream = client(url).completions.create(model=spec_models["target"], prompt=PROMPTS[i],
                                                    max_tokens=150, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True})
            outs[i] = [c.choices[0].finish_reason for c in stream if c.choices]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "stopped" in stderr
    # the startup heap, frozen while serving, is unfrozen: exit finalizes it
    assert "leaked" not in stderr
    assert all(outs[i][-1] == "length" for i in range(4))   # each stream ran to its end


@pytest.mark.slow
def test_a_second_sigint_cuts_the_running_requests_and_exits_0(tmp_path):
    """Ctrl-C twice while a whole and a streamed request run (each would take a minute): the server
    stops at once and exits 0, the requests aborted (it had crashed on its closed event loop, exit 1,
    after generating on for nobody)."""
    from conftest import write_checkpoint
    target = write_checkpoint(str(tmp_path / "slow"), "llama3", seed=1, num_layers=8, hidden=512,
                              max_positions=4096)
    with server_process(target) as (proc, url):
        def send(stream):
            body = json.dumps({"prompt": "The", "max_tokens": 4000, "ignore_eos": True, "stream": stream})
            request = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            with contextlib.suppress(OSError, http.client.HTTPException):   # the cut ends the answer
                urllib.request.urlopen(request, timeout=120).read()
        for stream in (False, True):
            threading.Thread(target=send, args=(stream,), daemon=True).start()
        time.sleep(1.5)
        start = time.time()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0 and time.time() - start < 15
        stderr = proc.stderr.read()
    assert "Event loop is closed" not in stderr and stderr.rstrip().endswith("stopped")


def test_bench_serve_measures_a_live_server(tiny_llm, capsys, tmp_path):
    """`python -m nanospec.bench serve` against the server: every request completes, output
    tokens are the server's count, and the figures are ordered as they must be."""
    from nanospec import bench_serve
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:3]))
    with serving(tiny_llm) as (server, url):
        args = bench_serve.build_parser().parse_args(["--base-url", url, "--num-prompts", "6",
                                                      "--max-concurrency", "3", "--dataset", str(dataset),
                                                      "--max-tokens", "8", "--extra-body",
                                                      '{"ignore_eos": true}'])
        report = bench_serve.run(args)
    assert report["completed"] == 6 and report["failed"] == 0 and report["output_tokens"] == 6 * 8
    assert 0 < report["ttft_s"]["p50"] <= report["e2el_s"]["p50"]
    assert report["itl_s"]["p50"] <= report["itl_s"]["max"] and report["request_throughput"] > 0
    assert "concurrency 3" in capsys.readouterr().out


def test_bench_serve_times_every_chunk_of_tokens_as_vllms_client_does():
    """A chunk is a step's tokens arriving, its text "" or not; chat's opening role chunk is not
    (it comes with the first token's, and would add a gap of zero)."""
    from nanospec.bench_serve import Client, Result
    chat = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": ""}}]},
            {"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 2}}]
    completions = [{"choices": [{"text": t}]} for t in ("a", "", "b")]
    for endpoint, chunks in (("chat", chat), ("completions", completions)):
        result = Result(start=time.perf_counter())
        for chunk in chunks:
            Client.take(chunk, result, endpoint)
        assert result.text == "ab" and len(result.chunk_times) == 3
        assert 0 < result.ttft <= result.latency


def test_bench_serve_sweeps_servers_in_turn_and_draws_them(tiny_llm, capsys, tmp_path):
    """--sweep: every server (here one server under two labels) at every load, the order rotated
    each round; each figure in the JSON is the median of its rounds; a PNG is written beside it."""
    from nanospec import bench_serve
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.json"
    with serving(tiny_llm) as (server, url):
        args = bench_serve.build_parser().parse_args([
            "--sweep", f"a={url}", f"K=4={url}", f"c={url}", "--concurrencies", "1,2", "--request-rates", "8",
            "--rounds", "2", "--num-prompts", "2", "--max-tokens", "4", "--pause", "0",
            "--extra-body", '{"ignore_eos": true}', "--out", str(out)])
        report = bench_serve.run(args)
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert [(r["label"], r.get("concurrency"), r.get("rate")) for r in report["rows"]] == [
        (label, c, rate) for c, rate in ((1, None), (2, None), (None, 8.0)) for label in ("a", "K=4", "c")]
    for row in report["rows"]:
        assert len(row["rounds"]) == 2 and all(r["completed"] == r["num_prompts"] for r in row["rounds"])
        assert row["rounds"][0]["num_prompts"] == max(2, 2 * row.get("concurrency", 0))
        tpots = [r["tpot_s"]["p99"] for r in row["rounds"]]
        assert row["median"]["tpot_p99"] == pytest.approx(sum(tpots) / 2)   # the median of two
        assert row["median"]["output_throughput"] > 0
    printed = [line.split(",")[0] for line in capsys.readouterr().out.splitlines() if ", " in line]
    assert printed[:6] == ["a", "K=4", "c", "a", "c", "K=4"]   # round 2: rotated by one, reversed
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_round_with_failed_requests_is_left_out_of_the_medians():
    from nanospec import bench_serve
    good = {"failed": 0, "output_throughput": 30.0, "tpot_s": {"p50": 0.1, "p99": 0.2}}
    failed = {"failed": 8, "output_throughput": 0.0, "tpot_s": {"p50": None, "p99": None}}
    assert bench_serve.medians([good, failed])["output_throughput"] == 30.0
    assert bench_serve.medians([failed])["output_throughput"] is None
    three = [{**good, "output_throughput": x} for x in (10.0, 60.0, 20.0)]
    assert bench_serve.medians(three)["output_throughput"] == 20.0   # the median, not the mean (30)


@pytest.mark.parametrize("flags, message", [
    ([], "give --base-url URL (one server) or --sweep LABEL=URL ... (several)"),
    (["--base-url", "http://x:1", "--sweep", "a=http://x:1"], "not both"),
    (["--sweep", "http://x:1"], "--sweep takes LABEL=URL"),
    (["--sweep", "a=http://x:1", "a=http://x:2", "--out", "s.json"], "labels must differ"),
    (["--sweep", "a=http://x:1"], "needs --out FILE.json"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--rounds", "0"], "--rounds >= 1"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--request-rate", "2"], "sets its loads with"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--max-concurrency", "2"], "sets its loads with"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--concurrencies", "1,x"], "take numbers like"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--concurrencies", "0"], "each above 0"),
    (["--sweep", "a=http://x:1", "--out", "s.json", "--concurrencies", "", "--request-rates", ""],
     "at least one load"),
])
def test_bench_serve_sweep_flags_are_checked_before_any_request(flags, message):
    from nanospec import bench_serve
    with pytest.raises(NanospecError, match=re.escape(message)) as e:
        bench_serve.run(bench_serve.build_parser().parse_args(flags))
    assert flags or "not both" not in str(e.value)   # neither given is not "both"


def test_bench_serve_runs_multiturn_sessions(tiny_llm, capsys):
    """--dataset multiturn: each later turn carries the server's earlier answers (found in its prefix
    cache), and TTFT is reported per turn."""
    from nanospec import bench_serve
    with serving(tiny_llm) as (server, url):
        before = metrics(url)["nanospec:prefix_cache_hits_total"]
        args = bench_serve.build_parser().parse_args(["--base-url", url, "--dataset", "multiturn",
                                                      "--num-prompts", "2", "--max-concurrency", "2",
                                                      "--max-tokens", "8"])
        report = bench_serve.run(args)
        hits = metrics(url)["nanospec:prefix_cache_hits_total"] - before
        rate = bench_serve.build_parser().parse_args(["--base-url", url, "--dataset", "multiturn",
                                                      "--request-rate", "2"])
        with pytest.raises(NanospecError,
                           match="--dataset multiturn sends each session's turns one after another"):
            bench_serve.run(rate)
    assert report["completed"] == 6 and report["failed"] == 0 and report["turns"] == 3
    assert set(report["ttft_s_by_turn"]) == {"1", "2", "3"} and hits > 0
    assert "turn 3: TTFT p50" in capsys.readouterr().out


@pytest.mark.parametrize("args, match", [
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--mixed-prefill-tokens", "-1"], "--mixed-prefill-tokens >= 0"),
    (["--prefill-first", "--mixed-prefill-tokens", "8"], "choose one"),
])
def test_bad_serve_flags_are_one_line_before_the_model_loads(tmp_path, capsys, args, match):
    from nanospec import serve
    assert serve.main(["--target", str(tmp_path / "never_loaded"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and match in err, err
