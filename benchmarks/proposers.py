"""Proposers side by side on one workload: each row a proposer at its K, an engine of its own over the same
target weights, the rows taking turns a step at a time (a shared machine's drift hits them alike; a row counts
its own steps' time only).

  --workload shipped     each shipped prompt once, in the chat template
  --workload multiturn   sessions whose later turns revisit earlier answers (nanospec/bench_serve.py's
                         multiturn_sessions)

Greedy, each answer ending at EOS or --max-new-tokens; every row must produce the same tokens (it
is checked in float32: speculation is lossless), so every row does the same work. In bfloat16 or
float16 a verify step's products round otherwise than a one-token step's and a greedy near-tie can
break otherwise: the rows that differ are counted and reported instead. Per row: tokens/s, mean
acceptance length (tokens a request gains per decode step) overall and per category, and for the
hybrid the share of steps it took the suffix draft and the threshold it measured. A fresh engine
per repeat and batch size: suffix decoding's global index starts empty each time, learning only
from the requests of that run, and so does its prefix cache (on by default; a row NAME@cold runs
without it, beside the same row with it).

example:
  python -m benchmarks.proposers --proposers ngram,suffix,eagle,hybrid --eagle HEAD --workload multiturn \\
      --batch-sizes 1,8

The flags are nanospec.bench's (the model, the proposer flags, --batch-sizes, --max-new-tokens, ...) and
--proposers, --workload, --turns.
"""
from __future__ import annotations

import copy
import sys
from collections import Counter, defaultdict

import torch

from nanospec import bench
from nanospec.bench_serve import multiturn_sessions
from nanospec.cli import Progress, log, log_loading, set_threads
from nanospec.dynamic_k import timed
from nanospec.sampling_params import SamplingParams
from nanospec.errors import NanospecError, check_int, run_command
from nanospec.llm import LLM, MAX_SPECULATIVE_TOKENS
from nanospec.prompts import by_category_in_turn, shipped_prompts
from nanospec.suffix import EXTRA_TOKENS, LLM_SETTINGS
from nanospec.tree import MAX_NODES


def suffix_flags(args) -> dict:
    """The --suffix-* settings, as LLM takes them."""
    return {name: getattr(args, name) for name in LLM_SETTINGS}


DYNAMIC = ("dynamic", "dynamic-per-request")   # a row's K by goodput: one for the batch, or per request
SUFFIX = lambda args: dict(suffix=True, **suffix_flags(args))   # its rows' settings
KINDS = {"plain": lambda args: {}, "ngram": lambda args: dict(ngram=True), "suffix": SUFFIX,
         "eagle": lambda args: dict(eagle=args.eagle), "draft": lambda args: dict(draft=args.draft),
         "hybrid": lambda args: dict(**SUFFIX(args),
                                     **(dict(eagle=args.eagle) if args.eagle else dict(draft=args.draft)))}


def parse_rows(text: str, args) -> list[tuple[str, int | str | None]]:
    """'ngram,suffix:8,hybrid:dynamic,suffix+0,ngram@cold,...' -> [(name, K)], K None unless given:
    the LLM's default (4; suffix and the hybrid 16, their ceiling; plain 0); "dynamic": --dynamic-k (a
    quick profile measured at start-up; the hybrid prices its own plans instead), "dynamic-per-request"
    with --per-request-k too (the budget placed request by request). A suffix or hybrid
    row's +N is its suffix_max_spec_offset, @cold turns its prefix caching off, @treeN drafts trees of
    at most N children a node (speculative_topk), an eagle or draft row's @treeNxD D deep
    (speculative_num_steps; row_settings), @records places a budget by each request's record alone,
    not by a confident drafter's confidence (DynamicK.trim), and an eagle row's @map drafts among
    --speculative-token-map's ids. Options add up: suffix@tree3@cold."""
    rows, kinds = [], set()
    for item in (x.strip() for x in text.split(",") if x.strip()):
        spec, *options = item.split("@")
        if any(where not in ("cold", "records", "map") and not tree_option(where) for where in options):
            raise NanospecError(f"--proposers: {item!r}: a row option after @ is cold (no prefix caching), "
                                "treeN (trees of at most N children a node), treeNxD (and D deep), records "
                                "(a budget by each request's record alone) or map (the token map)")
        name, _, k = spec.partition(":")
        name, plus, offset = name.partition("+")
        if name not in KINDS:
            raise NanospecError(f"--proposers: unknown proposer {name!r}; use {', '.join(KINDS)} (with :K)")
        if plus and (name not in ("suffix", "hybrid") or not offset.isdigit() or int(offset) > 16):
            raise NanospecError(f"--proposers: {item!r}: +N is a suffix or hybrid row's max_spec_offset, "
                                "0..16")
        try:
            k = 0 if name == "plain" else int(k) if k and k not in DYNAMIC else k or None
        except ValueError:
            raise NanospecError(f"--proposers: {item!r} is not NAME, NAME:K, NAME:dynamic or "
                                "NAME:dynamic-per-request") from None
        if isinstance(k, int):
            check_int(k, f"--proposers {name}'s K", low=0 if name == "plain" else 1,
                      high=MAX_NODES if any(map(tree_option, options)) else MAX_SPECULATIVE_TOKENS)
        if "records" in options and k != "dynamic-per-request":
            raise NanospecError(f"--proposers: {item!r}: @records is for a budget's rows, "
                                "NAME:dynamic-per-request")
        if name in ("eagle", "hybrid") and not (args.eagle or name == "hybrid" and args.draft):
            raise NanospecError(f"--proposers {name} needs a model drafter: add --eagle HEAD"
                                + (" (or --draft PATH)" if name == "hybrid" else ""))
        if name == "draft" and not args.draft:
            raise NanospecError("--proposers draft needs --draft PATH")
        if "map" in options and (name != "eagle" or not args.speculative_token_map):
            raise NanospecError(f"--proposers: {item!r}: @map is for an eagle row, with "
                                "--speculative-token-map FILE")
        rows.append((item, k))
        kinds.add(name)
    if not rows:
        raise NanospecError("--proposers names no row; e.g. --proposers ngram,suffix")
    for name, value in suffix_flags(args).items():
        if value is not None and not kinds & {"suffix", "hybrid"}:
            flag = "--" + name.replace("_", "-")
            raise NanospecError(f"{flag} is for suffix and hybrid rows: add one to --proposers")
    return rows


def tree_option(option: str) -> dict | None:
    """A row's @treeN or @treeNxD as LLM settings (speculative_topk, speculative_num_steps), else None."""
    topk, x, steps = option.removeprefix("tree").partition("x")
    if not option.startswith("tree") or not topk.isdigit() or x and not steps.isdigit():
        return None
    return dict(speculative_topk=int(topk), **(dict(speculative_num_steps=int(steps)) if x else {}))


def row_settings(item: str, args) -> dict:
    """A row's LLM settings: its kind's, a suffix or hybrid row's +N as its suffix_max_spec_offset,
    @cold as enable_prefix_caching=False (else --[no-]enable-prefix-caching: by default on) and @treeN
    as speculative_topk=N, @map as speculative_token_map (the rows without it draft over every id)."""
    spec, *options = item.split("@")
    kind, plus, offset = spec.partition(":")[0].partition("+")
    return {**KINDS[kind](args), **(dict(suffix_max_spec_offset=int(offset)) if plus else {}),
            **{key: value for option in options for key, value in (tree_option(option) or {}).items()},
            "enable_prefix_caching": False if "cold" in options else args.enable_prefix_caching,
            "speculative_token_map": args.speculative_token_map if "map" in options else None}


def run_rows(llms: dict, rows: list[str], sessions_of, batch_size: int, max_new_tokens: int,
             longest: int) -> dict:
    """Every row's sessions, at most batch_size at a time, a session's next turn queued as soon as
    its last answer is in; rows take turns a step at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    state = {}
    for name in rows:
        llm = llms[name]
        # a fresh engine (cache, scheduler, statistics, proposer state: an empty global index) with a
        # fresh copy of the LLM's K policy (a dynamic one starts from its profile again)
        engine = bench.row_engine(llm, batch_size, longest, k_policy=copy.deepcopy(llm.engine.k_policy))
        state[name] = dict(llm=llm, engine=engine, pending=sessions_of(), active={}, done=[], seconds=0.0)
    while True:
        busy = 0
        for name, row in state.items():
            engine, llm = row["engine"], row["llm"]
            while len(row["active"]) < batch_size and row["pending"]:
                session = row["pending"].pop(0)
                ids = llm.encode_chat(session.messages())
                if len(ids) + max_new_tokens > longest:
                    raise NanospecError(f"a session's turn is {len(ids)} tokens, past the {longest} "
                                        "sized for")
                req = engine.new_request(len(row["done"]), session.turns[len(session.answers)], ids, params)
                engine.add_requests([req])
                row["active"][id(req)] = (req, session)
            if not engine.scheduler.has_work():
                continue
            busy += 1
            row["seconds"] += timed(llm.device, engine.step)[1]
            for key, (req, session) in list(row["active"].items()):
                if req.finish_reason is not None:
                    del row["active"][key]
                    session.answers.append(req.text)
                    row["done"].append((session.category, req))
                    if not session.done:
                        row["pending"].insert(0, session)   # its next turn goes first
        if not busy:
            return state


def differing_requests(state: dict, reference: str) -> dict:
    """Per row, how many of its requests (prompt and tokens) the reference row has no equal of: a
    multiset difference, since in a multi-turn session a differing answer changes its later turns'
    prompts too, and rows finish their requests in different orders."""
    def requests(name):
        return Counter((tuple(r.prompt_ids), tuple(r.output_ids)) for _, r in state[name]["done"])
    counts = {name: sum((requests(name) - requests(reference)).values()) for name in state}
    return {name: n for name, n in counts.items() if n}


def summarize(name: str, row: dict) -> dict:
    tokens = sum(len(r.output_ids) for _, r in row["done"])
    steps = sum(r.decode_steps for _, r in row["done"])
    per_category = defaultdict(lambda: [0, 0])
    for category, req in row["done"]:
        per_category[category][0] += len(req.output_ids)
        per_category[category][1] += req.decode_steps
    stats = row["engine"].stats
    policy, max_k, proposer = row["engine"].k_policy, row["llm"].engine.max_k, row["engine"].proposer
    dynamic = not hasattr(policy, "k") or getattr(proposer, "plans", None)   # dynamic K, or a priced hybrid
    per_request = getattr(policy, "per_request", False)
    out = {"row": name, "k": ("dynamic-per-request" if per_request else "dynamic") if dynamic else policy.k,
           "tokens_per_s": round(tokens / row["seconds"], 2), "generated_tokens": tokens,
           "seconds": round(row["seconds"], 2), "prefill_steps": stats.prefill_steps,
           "decode_steps": stats.steps, "prefix_caching": row["engine"].kv_cache.allocator.prefix_caching,
           # prompt tokens, and those found cached
           "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
           "drafted_per_decode_step": round(stats.drafted_tokens / max(1, stats.steps), 3),
           "accepted_per_drafted": round(stats.accepted_tokens / max(1, stats.drafted_tokens), 3),
           "mean_acceptance_length": round(tokens / steps, 3),
           "acceptance_length_per_category": {c: round(t / s, 3) for c,
                                              (t, s) in sorted(per_category.items())}}
    if hasattr(proposer, "threshold"):   # the hybrid
        suffix_steps = sum(n for _, n in proposer.bins)
        out["hybrid_suffix_share"] = round(suffix_steps / max(1, suffix_steps + proposer.model_steps), 3)
        out["hybrid_threshold_at_k"] = proposer.threshold(max_k)
        if proposer.plans:   # priced (dynamic K): the decode steps that ran each plan
            out["hybrid_plans"] = dict(proposer.plans.chosen)
    if not hasattr(policy, "k"):
        out["chosen_k"] = stats.as_dict()["chosen_k"]   # batch size -> K -> decode steps
    if hasattr(proposer, "global_index"):
        out["global_index_requests"] = proposer.global_index.num_requests
    return out


def load_rows(args, rows: list, batch_sizes: list[int]) -> dict:
    """An LLM per row (the same target), at its K, with its settings."""
    set_threads(args.threads)
    log_loading(args.target)
    llms = {name: LLM(args.target, device=args.device, dtype=args.dtype, max_num_seqs=max(batch_sizes),
                      num_speculative_tokens=k if isinstance(k, int) and k else None,
                      dynamic_k=k in DYNAMIC, per_request_k=k == "dynamic-per-request",
                      log=log, enforce_eager=args.enforce_eager, **row_settings(name, args))
            for name, k in rows}
    for name, llm in llms.items():
        if "records" in name.split("@")[1:]:   # (its policy is copied into each repeat's fresh engine)
            llm.engine.k_policy.confident = False
    return llms


def measure_repeat(llms: dict, sessions_of, bs: int, repeat: int, args, longest: int) -> list[dict]:
    """One repeat of every row at batch size bs (each repeat starts at another row), checked against
    the first row: in float32 a row that decodes other tokens stops the run; in lower precision
    it is counted and reported."""
    names = list(llms)
    order = names[repeat % len(names):] + names[:repeat % len(names)]
    state = run_rows(llms, order, sessions_of, bs, args.max_new_tokens, longest)
    differ = differing_requests(state, names[0])
    dtype = llms[names[0]].dtype
    if differ and dtype == torch.float32:
        raise NanospecError(f"the rows decoded different tokens (requests unlike {names[0]}'s: "
                            f"{differ}): a proposer is not lossless")
    if differ:   # a verify step's products round otherwise than a one-token step's
        log(f"bench: in {str(dtype).removeprefix('torch.')} the rows decoded different tokens "
            f"(requests unlike {names[0]}'s: {differ}), as rounding breaks greedy near-ties "
            f"otherwise in steps of other shapes; --dtype float32 checks that every row is lossless")
    unlike = lambda name: ({"requests_unlike_reference_row": differ.get(name, 0), "reference_row": names[0]}
                           if differ else {})
    return [{"batch_size": bs, "repeat": repeat + 1, **summarize(name, row), **unlike(name)}
            for name, row in state.items()]


def run(args) -> dict:
    if args.ks != "0" or args.profile or args.oracle:
        raise NanospecError("--ks, --profile and --oracle are for K rows of one proposer; with --proposers "
                            "give each row its own K (NAME:K)")
    rows = parse_rows(args.proposers, args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    check_int(args.turns, "--turns", low=1, high=3)
    prompt_rows = by_category_in_turn(shipped_prompts([c for c in args.categories.split(",") if c]))
    prompt_rows = prompt_rows[:args.max_prompts] if args.max_prompts else prompt_rows
    if not prompt_rows:
        raise NanospecError(f"no shipped prompt is in --categories {args.categories!r}")
    turns = args.turns if args.workload == "multiturn" else 1
    llms = load_rows(args, rows, batch_sizes)
    first = next(iter(llms.values()))
    longest = min(first.max_model_len, 4096)
    results, progress = [], Progress("bench", len(batch_sizes) * args.repeats)
    for bs in batch_sizes:
        for repeat in range(args.repeats):
            measured = measure_repeat(llms, lambda: multiturn_sessions(prompt_rows, turns), bs, repeat, args,
                                      longest)
            line = ", ".join(f"{m['row']} {m['tokens_per_s']:.1f} tok/s AL {m['mean_acceptance_length']:.2f}"
                             for m in measured)
            progress.step(f"batch {bs}, repeat {repeat + 1}: {line}")
            results += measured
    offset = EXTRA_TOKENS if args.suffix_max_spec_offset is None else args.suffix_max_spec_offset
    return {"benchmark": f"proposers side by side, greedy, answers to EOS or {args.max_new_tokens} tokens, "
                         f"{args.workload} workload" + (f" ({turns} turns a session)" if turns > 1 else ""),
            "command": "python -m benchmarks.proposers " + " ".join(sys.argv[1:]),
            "target": first.target_name,
            "workload": args.workload, "sessions": len(prompt_rows), "turns": turns,
            "max_new_tokens": args.max_new_tokens, "eagle": args.eagle, "draft": args.draft,
            "suffix_max_spec_offset": offset,
            **{name: value for name, value in suffix_flags(args).items() if value is not None},   # the others
            "requests": len(prompt_rows) * turns,
            "outputs_identical_across_rows": not any("reference_row" in m for m in results),
            "results": results}


def print_table(report: dict) -> None:
    categories = sorted({c for r in report["results"] for c in r["acceptance_length_per_category"]})
    print(f"{'batch':>5} {'row':>12} {'tok/s':>8} {'AL':>6} " + " ".join(f"{c[:9]:>9}" for c in categories))
    for r in report["results"]:
        per = r["acceptance_length_per_category"]
        print(f"{r['batch_size']:>5} {r['row']:>12} {r['tokens_per_s']:>8.1f} "
              f"{r['mean_acceptance_length']:>6.2f} "
              + " ".join(f"{per.get(c, 0):>9.2f}" for c in categories))


def build_parser():
    """bench's flags, and the rows, the workload and its turns."""
    ap = bench.build_parser("python -m benchmarks.proposers", __doc__)
    ap.add_argument("--proposers", metavar="ROWS", required=True,
                    help="proposers side by side: comma-separated plain, ngram, suffix, eagle, draft, "
                         "hybrid, each with :K (default: the proposer's own, 4, or 16 for suffix and "
                         "hybrid); suffix+N, hybrid+N: that row's --suffix-max-spec-offset; NAME@cold: "
                         "without prefix caching; NAME@treeN: trees of at most N children a node "
                         "(--speculative-topk N), eagle@treeNxD, draft@treeNxD: D deep "
                         "(--speculative-num-steps D); NAME@records: a budget placed by each request's "
                         "record, not a confident drafter's confidence; eagle@map: drafting among "
                         "--speculative-token-map's ids; options add up (NAME@tree3@cold); "
                         "answers end at EOS")
    ap.add_argument("--workload", choices=["shipped", "multiturn"], default="shipped",
                    help="the shipped prompts once, or multi-turn sessions over them")
    ap.add_argument("--turns", type=int, default=3, metavar="N", help="turns a multi-turn session has, 1..3")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: bench.report(args, run(args), print_table))


if __name__ == "__main__":
    sys.exit(main())
