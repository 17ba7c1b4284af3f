"""Serve a model over the OpenAI API: POST /v1/completions and /v1/chat/completions (streamed as
server-sent events, or whole), GET /v1/models, /health and /metrics (Prometheus). One engine loop
(engine_loop.py) runs on the main thread, which built the model, and uvicorn on a thread beside it;
a request joins the running batch at the next step, its tokens stream as each step commits them,
and a client that goes away has its request aborted.

example:
  python -m nanospec.serve --ngram --port 8000
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 64}'
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.message
import functools
import itertools
import json
import signal
import socket
import sys
import threading
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanospec.cli import DEFAULT_MODEL, add_llm_args, frozen_gc_heap, load_llm, log, parser
from nanospec.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams
from nanospec.engine_loop import EngineLoop, QueueFull, TextStream, Update
from nanospec.errors import NanospecError, is_int, run_command, shown
from nanospec.metrics import Metrics
from nanospec.stats import acceptance_rates
from nanospec.tokenizer import utf8_decoder


class ApiError(Exception):
    """An error the client gets in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def body(self) -> dict:
        # (both may quote the request, whose JSON can hold lone surrogates, which UTF-8 cannot encode;
        # a value is quoted shortened (`as_json`), and a message past MAX_MESSAGE is cut, whatever made it)
        safe = lambda text: text and shown(text, MAX_MESSAGE, quote=False).encode(
            "utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": safe(self.message), "type": self.kind, "param": safe(self.param),
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# The fields a request may hold. Those of the OpenAI API nanospec does not implement are refused
# unless they hold their neutral value (best_of = 1, no echo, no tools), never silently ignored.
COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "stream_options", "ignore_eos", "skip_special_tokens", "stop_token_ids",
          "include_stop_str_in_output", "num_speculative_tokens", "user", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_p"}
FIELDS = {"completions": COMMON | {"prompt", "logprobs"},
          "chat": COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs",
                            "add_generation_prompt", "logprobs", "top_logprobs"}}
# (no key of NEUTRAL is in FIELDS)
NEUTRAL = {"best_of": (1,), "echo": (False,), "logit_bias": ({},), "suffix": ("",),
           "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False, True), "functions": ([],),
           "response_format": ({"type": "text"},)}


MAX_BODY_BYTES = 32 * 2**20   # a larger body is refused (413) before it is read whole
MAX_DEPTH = 16                # JSON nesting a body may have (a chat message's content parts: 4)
MAX_MESSAGE = 1000            # characters of an error message


async def read_body(request: HttpRequest) -> dict:
    """The one place a request body enters: sent as JSON (a Content-Type of application/json or
    +json, as FastAPI requires it), at most MAX_BODY_BYTES, JSON by the standard (no NaN or
    Infinity) within Python's limits (an integer's digits, nesting), and an object nested at most
    MAX_DEPTH deep. Every check after this reads a bounded dict; what fails here is a 4xx."""
    content_type = request.headers.get("content-type")
    if not is_json_type(content_type):
        raise ApiError(400, f"the request body must be sent as JSON: set the header 'Content-Type: "
                            f"application/json' (got {as_json(content_type)})")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB; send less")
    try:
        body = json.loads(data, parse_constant=not_json, parse_int=bounded_int)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply; send a JSON object") from None
    except ValueError as e:   # (JSONDecodeError, UnicodeDecodeError, not_json, bounded_int)
        raise ApiError(400, f"the request body is not valid JSON ({shown(e, quote=False)}); "
                            "send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if nesting(body) > MAX_DEPTH:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} deep; no field needs that")
    return body


def is_json_type(content_type: str | None) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json"
                                                                 or subtype.endswith("+json"))


def not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def bounded_int(digits: str) -> int:
    if len(digits) > sys.get_int_max_str_digits():
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


def nesting(value) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def as_json(value) -> str:
    """A value of the request as a message quotes it: in JSON, shortened (errors.shown)."""
    return shown(json.dumps(value), quote=False)


def check_fields(body: dict, endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in FIELDS[endpoint] and k not in NEUTRAL)
    if unknown:
        raise ApiError(400, f"unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)}: "
                            f"remove {'them' if len(unknown) > 1 else 'it'}", param=unknown[0])
    for key, neutral in NEUTRAL.items():
        if body.get(key) is not None and not is_neutral(body[key], neutral):
            raise ApiError(400, f"{key}={as_json(body[key])} is not supported by nanospec; remove it",
                           param=key)


def is_neutral(value, neutral: tuple) -> bool:
    """value is one of neutral's, a bool only as a bool (0 == False in Python: echo = 0 is not echo =
    false)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many of the most likely tokens' logprobs a request asks for at each position (0: only the
    sampled token's), or None: completions' logprobs = N; chat's logprobs = true with top_logprobs = N."""
    if not chat:
        return body.get("logprobs")   # (SamplingParams.validate checks it)
    wanted, top = bool_field(body, "logprobs", False), body.get("top_logprobs")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        raise ApiError(400, f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {as_json(top)}",
                       param="top_logprobs")
    if top and not wanted:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


# The API's neutral values of the sampling fields that a checkpoint's generation_config may set
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0}
# and the true / false fields, with their defaults
SWITCHES = {"ignore_eos": False, "skip_special_tokens": True, "include_stop_str_in_output": False}


def sampling_params(body: dict, default_max_tokens: int | None, defaults: dict,
                    chat: bool = False) -> SamplingParams:
    """The request's SamplingParams, checked (a NanospecError names the field). A field the request
    leaves out (or null) takes the checkpoint's default (LLM.sampling_defaults), else the API's."""
    max_tokens = body.get("max_tokens")
    if body.get("max_completion_tokens") is not None:
        if max_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")
        max_tokens = body["max_completion_tokens"]
    args = {key: body[key] if body.get(key) is not None else defaults.get(key, neutral)
            for key, neutral in SAMPLING.items()}
    args.update((key, bool_field(body, key, default)) for key, default in SWITCHES.items())
    if args["top_k"] == -1:   # "off" in vLLM, 0 in nanospec
        args["top_k"] = 0
    params = SamplingParams(
        **args, max_tokens=default_max_tokens if max_tokens is None else max_tokens, seed=body.get("seed"),
        stop=body.get("stop"), num_speculative_tokens=body.get("num_speculative_tokens"),
        logprobs=logprobs_asked(body, chat),
        stop_token_ids=[] if body.get("stop_token_ids") is None else body["stop_token_ids"])
    params.validate()
    return params


def bool_field(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false, got {as_json(value)}", param=key)
    return value


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, 'stream_options must be {"include_usage": true or false}', param="stream_options")
    if not body.get("stream"):
        raise ApiError(400, "stream_options is only for streamed requests (stream: true)",
                       param="stream_options")
    return bool_field(options, "include_usage", False)


def completion_prompts(llm, body: dict) -> list[tuple[str, list[int]]]:
    """Each prompt's text (for the record) and token ids: a string, a list of token ids, or a list
    of either (a batch of prompts, as the API and vLLM take them)."""
    prompt = body.get("prompt")
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    prompts = []
    for p in prompt if many else [prompt]:
        if isinstance(p, str):
            prompts.append((p, llm.tokenizer.encode(p)))
        elif isinstance(p, list) and p and all(is_int(t) for t in p):
            prompts.append(("", p))
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either, got "
                                + as_json(prompt), param="prompt")
    return prompts


def check_room(prompts: list[tuple[str, list[int]]], max_tokens: int, context: int, body: dict) -> None:
    """A prompt and max_tokens fit in the context, as vLLM's server requires (offline, generate stops
    at the context instead). A prompt alone over it is the engine's to refuse, in its own words."""
    for p, (_, ids) in enumerate(prompts):
        if len(ids) < context < len(ids) + max_tokens:
            key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise ApiError(400, f"{key} {max_tokens} is more than the context leaves: prompt {p} has "
                                f"{len(ids)} tokens of the {context} the model holds, so at most "
                                f"{context - len(ids)} may follow; lower {key}", param=key)


def usage(reqs: list, n: int, speculation: bool) -> dict:
    """prompt_tokens (each prompt's once for its n choices), completion_tokens (every choice's, the
    end-of-sequence token counted, as vLLM counts it), and with a proposer their own speculation:
    drafts found and accepted, the acceptance length (tokens a decode step with drafts gave them) and
    the acceptance rate per draft position. They count what verification accepted, before an end
    (EOS, a stop string) cut the output, as vLLM's counters do: a step whose accepted drafts ran
    past a stop string counts them all."""
    prompt, completion = sum(len(r.prompt_ids) for r in reqs[::n]), sum(len(r.output_ids) for r in reqs)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if speculation:
        steps, accepted = sum(r.spec_steps for r in reqs), sum(r.accepted for r in reqs)
        per_position = lambda name: [sum(c) for c in itertools.zip_longest(*(getattr(r, name) for r in reqs),
                                                                          fillvalue=0)]
        drafted_at, accepted_at = per_position("drafted_per_position"), per_position("accepted_per_position")
        out["speculation"] = {
            "draft_steps": steps, "draft_tokens": sum(r.drafted for r in reqs), "accepted_tokens": accepted,
            "acceptance_length": round(1 + accepted / steps, 4) if steps else None,
            "acceptance_rate_per_position": acceptance_rates(accepted_at, drafted_at)}
    return out


class Server:
    """The HTTP face: parses a request, queues it on the engine loop, answers whole or streamed."""

    def __init__(self, llm, name: str, api_key: str | None = None, max_waiting: int = 1024,
                 decode_between_prefills: bool = True, mixed_prefill_tokens: int = 0):
        self.llm, self.name, self.api_key = llm, name, api_key
        scheduler = llm.engine.scheduler
        scheduler.decode_between_prefills, scheduler.mixed_prefill_tokens = (decode_between_prefills,
                                                                             mixed_prefill_tokens)
        self.metrics = Metrics(llm.engine, name)
        self.loop = EngineLoop(llm.engine, self.metrics, max_waiting)
        self.created = int(time.time())

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):   # whoever made the server runs its loop (serve(), or loop.start())
            yield
            self.loop.stop(cut=True)   # uvicorn has finished or cancelled every response by now

        app = FastAPI(title="nanospec", lifespan=lifespan)

        @app.exception_handler(HTTPException)
        async def http_error(request: HttpRequest, e: HTTPException):   # an unknown path or method
            return ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                            headers=e.headers).response()   # (a 405's headers: Allow)

        @app.exception_handler(Exception)
        async def internal_error(request: HttpRequest, e: Exception):   # a defect: uvicorn logs its traceback
            return ApiError(500, f"internal error ({type(e).__name__}): {shown(e, quote=False)}",
                            kind="server_error").response()

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await self.handle(request, "completions")

        @app.post("/v1/chat/completions")
        async def chat(request: HttpRequest):
            return await self.handle(request, "chat")

        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        return app

    async def models(self, request: HttpRequest):
        if (error := self.auth_error(request)) is not None:
            return error.response()
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "nanospec", "root": self.llm.target_name,
                                            "max_model_len": self.llm.max_model_len}]}

    async def health(self):
        return Response(status_code=200 if self.loop.running else 503)

    async def prometheus(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def auth_error(self, request: HttpRequest) -> ApiError | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the "
                             "server's --api-key", code="invalid_api_key", kind="authentication_error")

    async def handle(self, request: HttpRequest, endpoint: str):
        try:
            if (error := self.auth_error(request)) is not None:
                raise error
            body = await read_body(request)
            reqs, n = self.new_requests(body, endpoint)
            reply = Reply(self, reqs, n, endpoint, body)   # checks stream_options
            updates: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()   # (choice, update)
            loop = asyncio.get_running_loop()
            self.loop.submit([(req, functools.partial(post_update, loop, updates, i))
                              for i, req in enumerate(reqs)])
        except ApiError as e:
            return e.response()
        except QueueFull as e:
            return ApiError(503, str(e), kind="server_error", code="queue_full",
                            headers={"Retry-After": "1"}).response()
        except NanospecError as e:   # a bad value, a prompt over the context: the engine's own one line
            return ApiError(400, str(e)).response()
        if body.get("stream"):
            return StreamingResponse(self.stream(reply, updates), media_type="text/event-stream")
        return await self.whole(request, reply, updates)

    def new_requests(self, body: dict, endpoint: str) -> tuple[list, int]:
        """The engine requests of the body's choices, n per prompt (chat and most completions have
        one prompt; a prompt's i-th seeded seed + i, vLLM's rule), and n."""
        check_fields(body, endpoint)
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(404, f"the model {as_json(model)} is not served here; use "
                                f"{json.dumps(self.name)} (GET /v1/models)", param="model",
                           code="model_not_found")
        bool_field(body, "stream", False)
        n, most = 1 if body.get("n") is None else body["n"], max(1, self.loop.max_waiting)
        if not (is_int(n) and 1 <= n <= most):   # (more than may wait could never be queued)
            raise ApiError(400, f"n must be an integer in 1..{most} (the server's --max-queue), got "
                                f"{as_json(n)}", param="n")
        llm = self.llm
        if endpoint == "chat":
            messages = body.get("messages")
            if not (isinstance(messages, list) and messages):
                raise ApiError(400, 'messages must be a non-empty list of {"role", "content"} objects',
                               param="messages")
            ids = llm.encode_chat(messages, chat_template_kwargs=body.get("chat_template_kwargs"),
                                  add_generation_prompt=bool_field(body, "add_generation_prompt", True))
            # chat: up to the context, or the checkpoint's max_new_tokens if less (vLLM's choice)
            prompts = [("", ids)]
            default_max = min(max(1, llm.max_model_len - len(ids)),
                              llm.sampling_defaults.get("max_tokens", llm.max_model_len))
        else:
            prompts, default_max = completion_prompts(llm, body), 16     # completions: the API's 16
        if len(prompts) * n > most:
            raise ApiError(400, f"{len(prompts)} prompts x n = {n} are more requests than may wait ({most}, "
                                "the server's --max-queue); send fewer", param="prompt")
        params = sampling_params(body, default_max, llm.sampling_defaults, chat=endpoint == "chat")
        check_room(prompts, params.max_tokens, llm.max_model_len, body)
        if params.seed is not None and params.seed + n - 1 > MAX_SEED:
            raise ApiError(400, f"with n = {n}, seed may be at most 2**63 - {n} (choice i is seeded "
                                f"seed + i), got {params.seed}", param="seed")
        # choice p * n + i: prompt p's i-th, as vLLM numbers them; an error names the prompt by its place
        return [llm.engine.new_request(p, text, ids, dataclasses.replace(
                    params, seed=None if params.seed is None else params.seed + i))
                for p, (text, ids) in enumerate(prompts) for i in range(n)], n

    async def whole(self, request: HttpRequest, reply: "Reply", updates: asyncio.Queue):
        """The whole answer once every choice finished. Whatever ends it before (the client gone, a
        choice failed, the handler cancelled at shutdown), the unfinished choices' requests are
        aborted."""
        checked, pending = time.monotonic(), set(range(len(reply.choices)))
        try:
            while pending:
                try:
                    i, update = await asyncio.wait_for(updates.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    update = None
                if time.monotonic() - checked >= 1.0:   # once a second, however fast the updates come
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return Response(status_code=499)
                if update is None or update.finish_reason is None:
                    continue
                reply.choices[i].last = update
                pending.discard(i)
                if update.finish_reason == "error":   # one choice failed: the answer is an error
                    return ApiError(500, update.error, kind="server_error").response()
            return reply.whole()
        finally:
            self.abort(reply, pending)

    async def stream(self, reply: "Reply", updates: asyncio.Queue):
        """Server-sent events: chat's role chunks once the first update came (after the prefill, as
        vLLM sends them: a client counts the first chunk as the first token), then per choice a chunk
        per step that gave it tokens, and its finish; then the usage if asked, and [DONE]. A step's
        chunk goes out even when its text is "" (a special token left out, a character or a stop
        string's start held back), as vLLM sends it: a client times each chunk as a token's arrival,
        and a step left out would show as a gap of two steps.
        If the client goes away, the response is cancelled here and the unfinished choices' requests
        aborted."""
        pending, started = set(range(len(reply.choices))), False
        try:
            while pending:
                i, update = await updates.get()
                if not started:
                    started = True
                    for chunk in reply.first_chunks():
                        yield sse(chunk)
                if update.finish_reason is not None:
                    pending.discard(i)
                if update.finish_reason == "error":   # the error, then [DONE] (no usage), as vLLM ends it
                    yield sse(ApiError(500, update.error, kind="server_error").body())
                    break
                choice = reply.choices[i]
                delta = choice.text.push(update)
                if update.new_ids or update.finish_reason:   # text or not (above)
                    yield sse(reply.chunk(choice, delta, update.finish_reason, update.logprobs))
            else:   # every choice finished, none failed
                if reply.include_usage:
                    yield sse(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            self.abort(reply, pending)

    def abort(self, reply: "Reply", unfinished: set[int]) -> None:
        for i in unfinished:
            self.loop.abort(reply.choices[i].req)


def post_update(loop, updates: asyncio.Queue, choice: int, update: Update) -> None:
    """A choice's listener: on the engine loop's thread, hands its update to the response's queue;
    once the HTTP server's event loop has closed (shut down), to no one."""
    with contextlib.suppress(RuntimeError):   # "Event loop is closed"
        loop.call_soon_threadsafe(updates.put_nowait, (choice, update))


class Choice:
    """One of a request's n choices: its engine request, its text as it streams, and where the next
    token of completions' logprobs starts in it."""

    def __init__(self, index: int, req, tokenizer):
        self.index, self.req = index, req
        self.text = TextStream(tokenizer, req.params.stop, req.params.skip_special_tokens)
        self.text_offset = 0
        self.decoder = utf8_decoder()   # the logprobs' tokens' bytes so far (a split character's held)
        self.last: Update | None = None   # its last update, once it finished


def text_added(decoder, data: bytes) -> str:
    """The text `data` would add after the bytes `decoder` has taken, which it leaves as they are."""
    probe = utf8_decoder()
    probe.setstate(decoder.getstate())
    return probe.decode(data)


class Reply:
    """One request's answer in the endpoint's shape, its n choices: whole, or as stream chunks."""

    def __init__(self, server: Server, reqs: list, n: int, endpoint: str, body: dict):
        self.server, self.chat, self.n = server, endpoint == "chat", n   # n: choices per prompt
        self.choices = [Choice(i, req, server.llm.tokenizer) for i, req in enumerate(reqs)]
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = include_usage(body)
        self.chunk_kind = "chat.completion.chunk" if self.chat else "text_completion"

    def head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.name}

    def usage(self) -> dict:
        return usage([c.req for c in self.choices], self.n, self.server.llm.engine.proposer is not None)

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            text, logprobs = c.last.text or "", self.logprobs(c, c.req.output_ids, c.req.logprobs)
            choices.append({"index": c.index, "message": {"role": "assistant", "content": text}}
                           if self.chat else {"index": c.index, "text": text})
            choices[-1].update(logprobs=logprobs, finish_reason=c.last.finish_reason)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head(kind), "choices": choices, "usage": self.usage()}

    def first_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        return [{**self.head(self.chunk_kind),
                 "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]} for c in self.choices]

    def chunk(self, choice: Choice, delta: str, finish_reason: str | None,
              logprobs: list[tuple[int, dict]] | None = None) -> dict:
        logprobs = (self.logprobs(choice, [t for t, _ in logprobs], [e for _, e in logprobs]) if logprobs
                    else None)
        content = {"delta": {"content": delta}} if self.chat else {"text": delta}
        body = {"index": choice.index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head(self.chunk_kind), "choices": [body]}

    def logprobs(self, choice: Choice, ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        """The OpenAI shape of these tokens' logprobs (None where not asked): chat's content list
        (token, logprob, bytes, the N most likely: by logprob, as the API says, where vLLM puts the
        sampled token first), completions' parallel lists (tokens, token_logprobs, top_logprobs:
        the N most likely and the sampled, text_offset). A token is the text it adds to the output
        (a character split across tokens comes whole with its last token, the others "", as vLLM
        corrects them; after a character left unfinished, the U+FFFD the output's text has there
        starts the next token's text, where vLLM leaves it out), its bytes its own (the API's:
        joined, they are the text's); -inf is -9999.0, as vLLM writes it (JSON has no infinity)."""
        if entries is None:
            return None
        raw = lambda t: self.server.llm.tokenizer.decode_bytes([t])
        value = lambda v: max(v, -9999.0)
        steps = []   # per token: its text, and each alternative's (the text it would have added there)
        for t, entry in zip(ids, entries):
            alternatives = {u: text_added(choice.decoder, raw(u)) for u in entry}
            steps.append((choice.decoder.decode(raw(t)), alternatives))
        if self.chat:
            item = lambda u, text, v: {"token": text, "logprob": value(v), "bytes": list(raw(u))}
            # e holds the sampled token's logprob and the N most likely's; chat lists the N most likely
            top = choice.req.params.logprobs
            return {"content": [{**item(t, text, e[t]),
                                 "top_logprobs": [item(u, alternatives[u], v) for u, v in
                                                  sorted(e.items(), key=lambda uv: -uv[1])[:top]]}
                                for t, e, (text, alternatives) in zip(ids, entries, steps)]}
        tokens = [text for text, _ in steps]
        offsets = list(itertools.accumulate(map(len, tokens), initial=choice.text_offset))
        choice.text_offset = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [value(e[t]) for t, e in zip(ids, entries)],
                "top_logprobs": [{alternatives[u]: value(v) for u, v in e.items()}
                                 for e, (_, alternatives) in zip(entries, steps)],
                "text_offset": offsets}

    def usage_chunk(self) -> dict:
        return {**self.head(self.chunk_kind), "choices": [], "usage": self.usage()}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def uvicorn_server(app, host: str, port: int, graceful_seconds: float = 30.0) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=graceful_seconds)
    return uvicorn.Server(config)


def serve(server: Server, sock: socket.socket, graceful_seconds: float = 30.0) -> None:
    """uvicorn on a thread of its own, the engine loop on this one (the thread that built the
    model: see engine_loop.py) until SIGINT / SIGTERM. Then uvicorn stops taking connections and
    lets the responses finish (`graceful_seconds` at most; a second SIGINT cuts them), its shutdown
    stops the loop, which aborts whatever it still holds (no response is left to hear it), and this
    returns. uvicorn off the main thread leaves signals alone (it would re-raise one after its
    shutdown and the process would die by it), so they are handled here."""
    host, port = sock.getsockname()[:2]
    http = uvicorn_server(server.app(), host, port, graceful_seconds)

    def answer():
        try:
            http.run(sockets=[sock])
        finally:
            server.loop.stop(cut=True)   # also when uvicorn fails, so the loop does not wait forever

    previous = {sig: signal.signal(sig, http.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=answer, name="http")
    thread.start()
    try:
        server.loop.run()
    finally:
        http.should_exit = True   # the loop ended by itself only if it failed: take HTTP down too
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_parser():
    ap = parser("python -m nanospec.serve", __doc__)
    add_llm_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", metavar="NAME",
                    help="the model's name in the API (default: --target)")
    ap.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1 requests")
    ap.add_argument("--max-queue", type=int, default=1024, metavar="N",
                    help="requests that may wait; past it a request gets 503 with Retry-After")
    ap.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                    help="requests in the running batch at most")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, metavar="N",
                    help="prompt tokens per prefill step (when nothing decodes, or with "
                         "--mixed-prefill-tokens 0)")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=0, metavar="N",
                    help="prompt tokens of prefill chunks each decode step carries in its forward, so an "
                         "arriving prompt does not stall the running streams (0: a whole chunk of "
                         "--max-num-batched-tokens runs between two decode steps)")
    ap.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                    help="auto: a request's sampling fields left out take the values of the checkpoint's "
                         "generation_config.json (temperature, top_p, top_k, min_p, the penalties; chat's "
                         "max_tokens from max_new_tokens), as vLLM's default does; vllm: the API's neutral "
                         "ones (default: auto)")
    ap.add_argument("--prefill-first", action="store_true",
                    help="run every prefill chunk before any decode step, as offline generate does "
                         "(running streams stall while a long prompt is prefilled)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    loaded = {}

    def load():
        if args.max_queue < 1 or not 0 <= args.port < 65536 or args.mixed_prefill_tokens < 0:
            raise NanospecError("--max-queue must be >= 1, --port in 0..65535 and "
                                "--mixed-prefill-tokens >= 0")
        if args.prefill_first and args.mixed_prefill_tokens:
            raise NanospecError("--prefill-first runs every prefill before any decode step, and "
                                "--mixed-prefill-tokens puts prefill chunks into decode steps: choose one")
        loaded["llm"] = load_llm(args, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens)

    status = run_command(load)
    if status:
        return status
    name = args.served_model_name or args.target or DEFAULT_MODEL
    llm = loaded["llm"]
    if llm.sampling_defaults:
        log("sampling defaults from the checkpoint's generation_config.json: "
            + ", ".join(llm.sampling_defaults_read)
            + " (a request's own values come first; --generation-config vllm for the neutral ones)")
        if llm.device.type == "cuda" and SamplingParams(**llm.sampling_defaults).processed:
            log("with these defaults every decode step replays only its forward as a CUDA graph (the LM "
                "head, penalties or min_p and sampling run eagerly); --generation-config vllm keeps "
                "whole-step graphs")
    server = Server(llm, name, args.api_key, args.max_queue, not args.prefill_first,
                    args.mixed_prefill_tokens)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port} ({e.strerror}); choose another --port",
              file=sys.stderr)
        return 2
    log(f"serving {name!r} on http://{args.host}:{sock.getsockname()[1]}/v1 (Ctrl-C to stop)")
    with frozen_gc_heap():   # the startup heap out of every full collection's scan, as vLLM's server keeps it
        serve(server, sock)
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
