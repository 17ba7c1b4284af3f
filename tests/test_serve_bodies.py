"""Whatever a client sends, the server answers it in the OpenAI shape with a status below 500, in
bounded time, and stays healthy: arbitrary JSON, a valid request with its fields mutated to any
JSON value, its text cut or spliced, numbers past Python's limits, nesting past its recursion
limit, bodies not sent as JSON. serve.read_body is the one place a body is parsed and bounded."""
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT  # noqa: F401 (tests/ on the path, as for every test module)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nanospec import LLM  # noqa: E402
from nanospec.serve import FIELDS, NEUTRAL  # noqa: E402
from test_serve import KV, serving  # noqa: E402

ENDPOINTS = {"completions": {"prompt": "The quick", "max_tokens": 4},
             "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
KEYS = sorted(set(FIELDS["chat"]) | set(FIELDS["completions"]) | set(NEUTRAL))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
# Values the JSON parser or a message would choke on: huge integers, deep nesting, non-JSON constants
raw_values = st.one_of(
    st.integers(4000, 6000).map(lambda n: "9" * n),
    st.integers(10, 3000).map(lambda d: "[" * d + "]" * d),
    st.integers(10, 3000).map(lambda d: '{"a":' * d + "1" + "}" * d),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", '"\\ud800"', '"' + "x" * 100_000 + '"']))


@st.composite
def bodies(draw):
    """(endpoint, raw bytes, Content-Type) of one request."""
    endpoint = draw(st.sampled_from(sorted(ENDPOINTS)))
    body = dict(ENDPOINTS[endpoint])
    kind = draw(st.sampled_from(["mutated", "arbitrary", "raw value", "cut", "content type"]))
    if kind == "arbitrary":
        return endpoint, json.dumps(draw(json_values)).encode(), "application/json"
    for key in draw(st.lists(st.sampled_from(KEYS) | st.text(max_size=6), max_size=4)):
        body[key] = draw(json_values)
    text = json.dumps(body)
    if kind == "raw value":
        text = text[:-1] + f', "{draw(st.sampled_from(KEYS))}": {draw(raw_values)}}}'
    if kind == "cut":
        start = draw(st.integers(0, len(text)))
        end = draw(st.integers(start, len(text)))
        text = text[:start] + draw(st.text(max_size=4)) + text[end:]
    content_type = "application/json"
    if kind == "content type":
        content_type = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                             "application/json; charset=utf-8", "application/vnd.api+json",
                                             "multipart/form-data", "json", ""]))
    return endpoint, text.encode("utf-8", "surrogatepass"), content_type


def send(url: str, endpoint: str, data: bytes, content_type: str | None) -> tuple[int, bytes]:
    """(status, body) of one POST; content_type None: no Content-Type header at all."""
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    connection = http.client.HTTPConnection(urllib.parse.urlsplit(url).netloc, timeout=60)   # a hang fails
    try:
        headers = {} if content_type is None else {"Content-Type": content_type}
        connection.request("POST", path, body=data, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def fuzz_server(spec_models):
    llm = LLM(spec_models["target"], **KV, max_model_len=256)
    with serving(llm, max_waiting=8) as (server, url):   # n is at most 8: every answer is quick
        yield url


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(request=bodies())
def test_no_body_gets_a_5xx_a_hang_or_a_sick_server(fuzz_server, request):
    endpoint, data, content_type = request
    status, answer = send(fuzz_server, endpoint, data, content_type)
    assert status < 500, answer[:300]
    if status >= 400:
        error = json.loads(answer)["error"]
        assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) <= 1000
    else:   # whole, or streamed: no error event in the stream
        assert b'"server_error"' not in answer, answer[:300]
    assert urllib.request.urlopen(fuzz_server + "/health", timeout=10).status == 200


def test_a_405_keeps_its_allow_header(fuzz_server):
    for path, allowed in (("/v1/completions", "POST"), ("/health", "GET")):
        method = "GET" if allowed == "POST" else "POST"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(fuzz_server + path, method=method), timeout=10)
        assert e.value.code == 405 and e.value.headers["Allow"] == allowed
        assert set(json.loads(e.value.read())["error"]) == {"message", "type", "param", "code"}
