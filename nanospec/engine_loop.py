"""The engine's loop, for the server: requests join the running batch at the next step and leave
when they finish or are aborted; each step's new tokens go to the request's listener.

The engine is touched by the loop's thread only. Other threads (the HTTP server's) hand it requests
and aborts through `submit` and `abort`, which only queue them; between two steps the loop takes
what was queued, so the scheduler and the K policy see the real running and waiting queues. A
listener is called on the loop's thread with an Update after every step that gave its request
tokens, and once at the end; it must not block (the server's posts the update to its event loop).

The loop runs on the thread that built the model (`run()`; the server's main thread): torch's CPU
ops run their OpenMP teams per calling thread, and a second thread's team on cores that the first
team's threads also wait on slows every parallel op (python -m benchmarks.torch_thread_teams measures it).
`start()`, a thread of its own, is for tests.

TextStream turns a request's tokens into text deltas as a client should see them: whole UTF-8
characters only, and no text that could still turn out to be the start of a stop string.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from nanospec.engine import Engine
from nanospec.request import Request
from nanospec.errors import NanospecError
from nanospec.tokenizer import utf8_decoder


class QueueFull(NanospecError):
    pass


@dataclass
class Update:
    new_ids: list[int]               # tokens committed since the last update
    finish_reason: str | None = None   # "stop", "length" or "error" on the last update (an abort sends none)
    text: str | None = None          # the whole output text, on the last update (the engine's req.text)
    error: str | None = None         # why it failed (finish_reason "error")
    logprobs: list[tuple[int, dict]] | None = None   # (token, {id: logprob}) of each new token, if asked


@dataclass
class Tracked:
    req: Request
    listener: object                 # called with an Update on the loop's thread
    arrival: float
    sent: int = 0                    # output tokens handed to the listener
    first: float | None = None       # when the first token came
    last: float | None = None        # when the latest came


class EngineLoop:
    def __init__(self, engine: Engine, metrics=None, max_waiting: int = 1024):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.inbox: deque[Tracked] = deque()        # submitted, not yet in the engine
        self.aborts: deque[Request] = deque()
        self.tracked: dict[int, Tracked] = {}       # id(request) -> its record, while in the engine
        self.stopping = False
        self.cut = False                            # stop() was told to drop what it holds
        self.running = False                        # run() is taking requests and stepping
        self.thread: threading.Thread | None = None   # the loop's own thread, when start() made one

    def start(self) -> "EngineLoop":
        """Run the loop on a thread of its own (slower on CPU: see above)."""
        self.thread = threading.Thread(target=self.run, name="nanospec-engine", daemon=True)
        self.thread.start()
        return self

    def num_waiting(self) -> int:
        return len(self.inbox) + len(self.engine.scheduler.waiting)   # a deque's len is safe to read

    def submit(self, requests: list[tuple[Request, object]]) -> None:
        """Queue (request, listener) pairs, requests made by engine.new_request, all or none:
        QueueFull when max_waiting would be passed."""
        with self.lock:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if self.num_waiting() + len(requests) > self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests may wait and {self.num_waiting()} already do; "
                                "retry later")
            now = time.perf_counter()
            self.inbox.extend(Tracked(req, listener, now) for req, listener in requests)
            self.wake.notify()

    def abort(self, req: Request) -> None:
        """Drop a request at the next step (its client went away), with its blocks and proposer state."""
        with self.lock:
            self.aborts.append(req)
            self.wake.notify()

    def stop(self, timeout: float | None = None, cut: bool = False) -> None:
        """Stop taking requests; the loop finishes what it holds, then ends (waited for when it
        runs on a thread start() made). cut: it aborts what it holds instead, at the next step (the
        HTTP server has ended: no response is left to hear them)."""
        with self.lock:
            self.stopping, self.cut = True, self.cut or cut
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def run(self) -> None:
        """Step until stop(): on this thread, which should be the one that built the model."""
        engine, self.running = self.engine, True
        try:
            while True:
                with self.lock:
                    while not (self.inbox or self.aborts or engine.scheduler.has_work() or self.stopping):
                        self.wake.wait()
                    arrived, self.inbox = list(self.inbox), deque()
                    aborted, self.aborts = list(self.aborts), deque()
                if self.cut:   # everything it holds or was handed goes
                    aborted += [t.req for t in [*arrived, *self.tracked.values()]]
                if self.stopping and not (arrived or engine.scheduler.has_work()):
                    return
                self.tracked.update((id(t.req), t) for t in arrived)
                engine.add_requests([t.req for t in arrived])
                self.drop(aborted)
                if engine.scheduler.has_work():
                    self.step()
        finally:
            self.running = False

    def step(self) -> None:
        engine = self.engine
        try:
            updated = engine.step()
        except Exception as e:   # a bug, not a request's fault: fail what the engine holds and go on
            held = [t.req for t in self.tracked.values()]
            engine.abort(held)
            for req in held:
                req.finish_reason, req.error = "error", f"the engine failed: {type(e).__name__}: {e}"
            updated = held
        now = time.perf_counter()
        if self.metrics:
            self.metrics.after_step(was_decode=not engine.scheduler.last_was_prefill)
        for req in updated:
            t = self.tracked.get(id(req))
            if t is not None:
                self.deliver(t, now)

    def deliver(self, t: Tracked, now: float) -> None:
        req = t.req
        new = req.output_ids[t.sent:]
        logprobs = None if req.logprobs is None else list(zip(new, req.logprobs[t.sent:]))
        if new:
            if t.first is None:
                t.first = now
                if self.metrics:
                    self.metrics.ttft.observe(now - t.arrival)
            elif self.metrics:
                self.metrics.itl.observe(now - t.last)
            t.last, t.sent = now, t.sent + len(new)
        done = req.finish_reason is not None
        if done:
            del self.tracked[id(req)]
            if self.metrics:
                self.metrics.finished_request(req, req.finish_reason, t.arrival, t.first, t.last or now)
        t.listener(Update(new, req.finish_reason, req.text if done else None, req.error, logprobs))

    def drop(self, aborted: list[Request]) -> None:
        gone = [self.tracked.pop(id(r)) for r in aborted if id(r) in self.tracked]
        self.engine.abort([t.req for t in gone])
        if gone and self.metrics:
            for t in gone:
                self.metrics.finished_request(t.req, "abort", t.arrival, t.first, time.perf_counter())
            self.metrics.update_queues()


class TextStream:
    """A request's text as it grows: push() the token ids of each update, get the text a client may
    see now. Held back: a character whose bytes have not all come, and any end of the text that is
    the start of a stop string (the engine may yet end the output before it). The last update's
    text (the engine's, cut at any stop) completes it, so the deltas add up to it exactly.

    Each update decodes only its own tokens: an incremental UTF-8 decoder keeps the bytes of a
    character split across tokens until the rest comes, and gives what decoding all the bytes at
    once gives (U+FFFD where they are not UTF-8), so decoding a whole answer is linear in its length
    (the text itself is appended to, a copy per update, cheap beside decoding)."""

    def __init__(self, tokenizer, stops: list[str], skip_special: bool = True):
        self.tokenizer, self.stops, self.skip_special = tokenizer, stops, skip_special
        self.decoder = utf8_decoder()
        self.text = ""   # the whole characters decoded so far
        self.sent = 0    # characters handed out: text[:sent]

    def push(self, update: Update) -> str:
        if update.finish_reason is not None:
            text = update.text or ""
            if not text.startswith(self.text[:self.sent]):   # (not with a prefix-stable decode): never resend
                return ""
            end = len(text)
        else:
            self.text += self.decoder.decode(self.tokenizer.decode_bytes(update.new_ids, self.skip_special))
            text = self.text
            end = len(text) - held_back(text, self.stops)   # (max below: never before the last end)
        delta, self.sent = text[self.sent:end], max(self.sent, end)
        return delta


def held_back(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that is the start of a stop string."""
    return max((n for stop in stops for n in range(min(len(stop), len(text)), 0, -1)
                if stop.startswith(text[-n:])), default=0)
