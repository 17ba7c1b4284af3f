"""Replay: the dynamic-K policy against static K on a recorded n-gram workload, without a machine's noise.

Greedy decoding is deterministic and n-gram drafts depend only on the tokens so far, so one plain
greedy run of a prompt set fixes, for every request and every output position p, how many drafts
the proposer finds there and how many of them the target accepts (a Trace). Any K schedule can
then be stepped through exactly as the engine would step it: the same requests, the same tokens,
the same accepted drafts. Only the clock is a model: a step of B requests that verify D drafts in
all takes ITL(B, D / B) seconds of a step-time table (a dynamic-K Profile, interpolated as the
policy interpolates it). With the table as both the clock and the policy's profile, the policy's
choices are judged on what they are worth, not on a shared CPU's 10-30% drift between rows.

The workload is the benchmark's: every request writes max_new_tokens tokens, EOS or not (on traces
that stopped at EOS, a different workload, dynamic K looked 1-2% closer to the best static K than
on these, at 36bc668 with the bench's profile). Decode steps only: prefill costs every row the same
and is left out, so the ratios between rows are those of the decode time, a little wider than a
benchmark's.

    python -m benchmarks.replay --profile profile.json --batch-sizes 1,4,16 --num-requests 48 [--continuous]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from nanospec import LLM, SamplingParams
from nanospec.cli import HelpFormatter, add_model_args, int_list, set_threads
from nanospec.dynamic_k import DynamicK, Profile, itl_at
from nanospec.errors import NanospecError, run_command
from nanospec.k_policy import KPolicy, StaticK
from nanospec.prompts import shipped_prompts
from nanospec.proposer import NgramIndex


@dataclass(slots=True)
class Trace:
    """One request's greedy output, as a proposer with up to max_k drafts a step sees it."""
    length: int            # output tokens (max_tokens, or fewer where EOS came first)
    found: list[int]       # [length]: drafts the proposer finds at output position p (<= max_k)
    matched: list[int]     # [length]: how many of them, from the first, are the target's next tokens


@dataclass(slots=True)
class Running:
    trace: Trace
    done: int = 0                                    # output tokens emitted so far


def ngram_trace(prompt: list[int], output: list[int], max_k: int, min_n: int = 1, max_n: int = 4) -> Trace:
    """What NgramProposer drafts at each output position: the n-gram index over prompt + output[:p]
    (drafts for a smaller K are the first K of these: the proposer takes the tokens after one match)."""
    index, tokens, found, matched = NgramIndex(min_n, max_n), list(prompt), [], []
    for p in range(len(output)):
        draft = index.lookup(tokens, max_k)
        m = 0
        while m < len(draft) and p + m < len(output) and draft[m] == output[p + m]:
            m += 1
        found.append(len(draft))
        matched.append(m)
        tokens.append(output[p])
    return Trace(len(output), found, matched)


def replay(traces: list[Trace], batch_size: int, policy: int | KPolicy, clock: Profile, max_tokens: int,
           continuous: bool = False) -> tuple[int, float]:
    """Step the traces as the engine would with a static K (an int) or a DynamicK; (tokens, seconds).
    In groups (the bench's default, as generate() runs them) batch_size requests start together and
    the next group starts when the last of them is done; continuous: a finished request's place is
    taken by the next. Each request's K is capped as the engine caps it (K accepted + 1 <= tokens left)."""
    if batch_size < 1:
        raise NanospecError(f"batch size must be >= 1, got {batch_size}")
    policy = StaticK(policy) if isinstance(policy, int) else policy
    queue, running, tokens, seconds = [Running(t) for t in traces], [], 0, 0.0
    while queue or running:
        if continuous or not running:
            while queue and len(running) < batch_size:
                running.append(queue.pop(0))
        # the engine's queue: in groups (a generate() call each) nothing waits to join the group
        ks = policy.choose(running, len(running) + (len(queue) if continuous else 0))
        ks = [max(0, min(k, max_tokens - r.done - 1)) for k, r in zip(ks, running)]
        found = [min(k, r.trace.found[r.done]) for k, r in zip(ks, running)]
        accepted = [min(f, r.trace.matched[r.done]) for f, r in zip(found, running)]
        step = itl_at(clock.itl(len(running)), sum(found) / len(running))   # the clock
        policy.observe(ks, accepted, found, seconds=step, requests=running)
        seconds += step
        for r, a in zip(running, accepted):
            emitted = min(a + 1, r.trace.length - r.done)   # a request stops at its EOS
            r.done += emitted
            tokens += emitted
            if r.done >= r.trace.length:
                policy.forget(r)   # as the engine does when a request finishes
        running = [r for r in running if r.done < r.trace.length]
    return tokens, seconds


def compare(traces: list[Trace], batch_size: int, profile: Profile, max_tokens: int, continuous: bool = False,
            max_k: int | None = None, policy_profile: Profile | None = None, **policy_options) -> dict:
    """Tokens/s of every static K = 0..max_k (default the profile's) and of dynamic K up to max_k, the
    clock being `profile`; the policy goes by policy_profile (default the clock: a profile without error)."""
    max_k = profile.max_k if max_k is None else max_k
    rows = {}
    for k in range(max_k + 1):
        tokens, seconds = replay(traces, batch_size, k, profile, max_tokens, continuous)
        rows[str(k)] = tokens / seconds
    # the traces are n-gram's (Proposer.acceptance_in_spans)
    policy_options = {"spans": True, **policy_options}
    policy = DynamicK(policy_profile or profile, max_k, **policy_options)
    tokens, seconds = replay(traces, batch_size, policy, profile, max_tokens, continuous)
    rows["dynamic"] = tokens / seconds
    best = max(v for k, v in rows.items() if k != "dynamic")
    return {"tokens_per_s": rows, "dynamic_over_best": rows["dynamic"] / best}


# ---- command line: record SmolLM2's (or any target's) greedy outputs, then replay them ----

def record_traces(args) -> list[Trace]:
    categories = args.categories.split(",") if args.categories else None
    rows = shipped_prompts(categories)
    if not rows:
        raise NanospecError(f"no shipped prompt is in the categories {args.categories!r}")
    set_threads(args.threads)
    llm = LLM(args.target, device=args.device, dtype=args.dtype, ngram=True, max_num_seqs=len(rows))
    prompts = [llm.encode_prompt(r["prompt"], chat=True) for r in rows]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_new_tokens,
                                                   ignore_eos=True))
    ngram = llm.engine.proposer
    traces = [ngram_trace(p, o.token_ids, args.max_k, ngram.min_n, ngram.max_n) for p,
              o in zip(prompts, outputs)]
    return [traces[i % len(traces)] for i in range(args.num_requests or len(traces))]


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.replay", description=__doc__.splitlines()[0],
                                 epilog="example:\n  python -m benchmarks.replay --profile "
                                        "PROFILE.json --num-requests 48",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--profile", required=True,
                    help="step-time table (python -m nanospec.profiler): the clock")
    ap.add_argument("--policy-profile",
                    help="the profile the policy goes by (default: --profile, i.e. without error)")
    ap.add_argument("--categories", default="code_edit,summarize,extract", help="shipped prompt categories")
    ap.add_argument("--batch-sizes", default="1,4,16", help="comma-separated batch sizes to replay")
    ap.add_argument("--num-requests", type=int, default=0, help="cycle the prompts to this many requests")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens every request generates")
    ap.add_argument("--max-k", type=int, default=6, help="static rows K = 0..max-k; dynamic K's largest")
    ap.add_argument("--continuous", action="store_true",
                    help="refill the batch as requests finish (else groups)")
    ap.add_argument("--per-request-k", action="store_true", help="dynamic K with a K per request")
    add_model_args(ap)
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def replay_command(args) -> None:
    profile = Profile.load(args.profile)
    policy_profile = Profile.load(args.policy_profile) if args.policy_profile else None
    if not 1 <= args.max_k <= profile.max_k:
        raise NanospecError(f"--max-k must be in 1..{profile.max_k} (the profile times K up to "
                            f"{profile.max_k}), got {args.max_k}")
    if args.num_requests < 0:
        raise NanospecError(f"--num-requests must be >= 0, got {args.num_requests}")
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    if not batch_sizes or min(batch_sizes) < 1:
        raise NanospecError(f"--batch-sizes takes batch sizes >= 1, got {args.batch_sizes!r}")
    traces = record_traces(args)
    print(f"{len(traces)} requests, {sum(t.length for t in traces)} tokens; "
          f"{'continuous' if args.continuous else 'groups'}; tokens/s of decode time on the profile's clock")
    for batch in batch_sizes:
        if batch > profile.batch_sizes[-1]:
            print(f"  (batch {batch} is beyond the profile's batch sizes: extrapolated)")
        result = compare(traces, batch, profile, args.max_new_tokens, args.continuous, args.max_k,
                         policy_profile, per_request=args.per_request_k)
        rows = "  ".join(f"{k if k == 'dynamic' else 'K=' + k}: {v:.1f}" for k,
                         v in result["tokens_per_s"].items())
        print(f"batch {batch}: {rows}  dynamic / best {result['dynamic_over_best']:.3f}")


def main(argv=None) -> int:
    return run_command(lambda: replay_command(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
