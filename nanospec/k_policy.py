"""How many drafts each request verifies in a decode step: the interface the engine asks.

The engine receives one KPolicy when it is built and, before each decode step, asks it for a K per
request of the step (`choose`), then lets it cut the drafts made (`trim`); after the step it tells
it what happened (`observe`), and when a request leaves, `forget`s it. A policy keeps whatever it
learns (per-request records included) to itself; the engine never reads it, and caps each K at what
the request can still emit.

StaticK is one K for every request of every step; QueueSwitch wraps a policy and turns speculation
off while more than a number of requests wait or run; dynamic_k.DynamicK chooses K by goodput.
"""
from __future__ import annotations


class KPolicy:
    def choose(self, requests: list, queue_size: int) -> list[int]:
        """K for each of the step's requests; queue_size: the requests waiting or running."""
        raise NotImplementedError

    def observe(self, ks: list[int], num_accepted: list[int], num_draft: list[int] | None = None,
                seconds: float | None = None, requests: list | None = None,
                paths: list[list[int]] | None = None) -> None:
        """After a decode step: request b asked for ks[b] drafts, the proposer found num_draft[b],
        num_accepted[b] were accepted (a tree's: the nodes paths[b], stats.accepted_positions); the
        step took `seconds` (None: not timed)."""

    def trim(self, requests: list, ks: list[int], proposal):
        """The step's proposal (proposer.Proposal) for requests that asked for ks, cut to the drafts
        worth verifying, and each request's K as it then counts: a policy that weighs the drafter's
        own confidence in each draft (dynamic_k.DynamicK) cuts them; the others verify every draft."""
        return ks, proposal

    def forget(self, request) -> None:
        """The request finished or was dropped: whatever the policy kept about it can go."""


class StaticK(KPolicy):
    def __init__(self, k: int):
        self.k = k

    def choose(self, requests, queue_size):
        return [self.k] * len(requests)


class QueueSwitch(KPolicy):
    """`inner`, except K = 0 while more than `max_queue` requests wait or run: under load the
    verify step's extra tokens cost more than the accepted drafts save."""

    def __init__(self, inner: KPolicy, max_queue: int):
        self.inner, self.max_queue = inner, max_queue

    def choose(self, requests, queue_size):
        return [0] * len(requests) if queue_size > self.max_queue else self.inner.choose(requests, queue_size)

    def observe(self, *args, **kwargs):
        self.inner.observe(*args, **kwargs)

    def trim(self, requests, ks, proposal):
        return self.inner.trim(requests, ks, proposal)

    def forget(self, request):
        self.inner.forget(request)
