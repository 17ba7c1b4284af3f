"""Benchmark decode throughput over the shipped prompt set, plain and speculative, next to
transformers' generate() on the same model and prompts in the same run. Every request generates
exactly --max-new-tokens tokens (EOS ignored, greedy), so both engines do the same work. Requests
run in groups of the batch size, each group to completion (what batched generate() does), or with
--continuous as a server runs them: all queued, a finished request's place taken by the next. The
rows (K values) run side by side, each an engine of its own over the same weights, taking turns a
step at a time, so that the drift of a shared machine hits them alike. Prints a table; --out
writes JSON with the device, versions and command.

examples:
  python -m nanospec.bench --batch-sizes 1,8,32 --max-new-tokens 64
  python -m nanospec.bench --ngram --ks 0,2,4,6 --batch-sizes 1 --categories code_edit,summarize,extract
  python -m nanospec.bench --ngram --ks 0,4,dynamic --batch-sizes 4 --num-requests 48 --continuous \\
      --no-transformers --out bench.json
  python -m nanospec.bench serve --base-url http://127.0.0.1:8000 --max-concurrency 4   # bench_serve.py
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import sys

import torch

from nanospec import checkpoint
from nanospec.checkpoint import unpack_weights
from nanospec.cli import (Progress, add_model_args, add_proposer_args, int_list, load_llm, parser,
                          proposer_given)
from nanospec.dynamic_k import DynamicK, Profile, device_name, greedy_requests, timed, twin
from nanospec.engine import Engine
from nanospec.errors import NanospecError, check_int, run_command
from nanospec.k_policy import StaticK
from nanospec.llm import DEFAULT_DYNAMIC_MAX_K, LLM, MAX_SPECULATIVE_TOKENS, kv_block_bytes
from nanospec.prompts import by_category_in_turn, shipped_prompts
from nanospec.proposer import OracleProposer


# ---- the transformers baseline: the same checkpoint (a folder, a .gguf, or a random model holding our own
# weights) and its generate() over the same groups of prompts -------------------------------------------

def transformers_model(target: str | None, dtype: torch.dtype, device: torch.device, ours=None):
    """The same checkpoint in transformers (a folder or hub id, None the default model, or a .gguf
    through transformers' own GGUF reader); for random:NAME, a transformers model of its config
    holding `ours`'s random weights."""
    import transformers
    if target and target.startswith("random:"):
        return random_transformers_model(target, ours, dtype, device)
    path = checkpoint.resolve(target)
    if not path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = load_gguf_checkpoint(path)["config"]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    weights = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.to(device=device, dtype=dtype).eval()


def random_transformers_model(path: str, ours, dtype: torch.dtype, device: torch.device):
    """transformers' model of random:NAME's config, with our model's weights (so both compute the
    same function: the same greedy tokens, the same drafts accepted)."""
    import transformers
    config = dict(checkpoint.RANDOM_MODELS[path.removeprefix("random:")])
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[config["architectures"][0]]
    hf_config = transformers.AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    weights = unpack_weights({k: v for k, v in ours.state_dict().items() if "rotary" not in k}, ours.config)
    model.load_state_dict(weights, strict=False, assign=True)   # our tensors themselves: no second copy
    model.tie_weights()
    with torch.device(device):   # the rotary tables, buffers made at init, made for real
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"not loaded: {left[:3]}"
    return model.eval()


def groups(prompt_ids: list[list[int]], batch_size: int, continuous: bool = False) -> list[list[list[int]]]:
    """How the bench runs the prompts: batch_size at a time, or all at once (continuous)."""
    size = len(prompt_ids) if continuous else batch_size
    return [prompt_ids[first:first + size] for first in range(0, len(prompt_ids), size)]


def time_transformers(model, prompt_ids: list[list[int]], batch_size: int, max_new_tokens: int, pad_id: int,
                      **speculative) -> float:
    """transformers' generate() over the same groups; `speculative`: prompt_lookup_num_tokens=K or
    assistant_model=... (transformers supports those at batch size 1 only)."""
    elapsed, tokens = 0.0, 0
    for group in groups(prompt_ids, batch_size):
        longest = max(len(ids) for ids in group)   # left padding, as batched generate() needs
        ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group], device=model.device)
        out, seconds = timed(model.device, lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id, **speculative))
        elapsed += seconds
        assert out.shape[1] == longest + max_new_tokens
        tokens += len(group) * max_new_tokens
    return tokens / elapsed


# ---- the roofline: bytes a plain step reads, over the device's measured copy bandwidth -------------------

def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second a device-to-device copy reads and writes: 5 copies after a warm-up
    (benchmarks/measure.time_copy is the GPU check's, with CUDA's own timers)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * 5 * src.numel() / timed(device, lambda: [dst.copy_(src) for _ in range(5)])[1]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())   # a tied weight counts once


# ---- nanospec's rows ---------------------------------------------------------------------------------------

def oracle_proposer(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int) -> OracleProposer:
    """An OracleProposer of each prompt's plain greedy continuation, recorded on an engine of its
    own over the same weights (its KV pool just large enough)."""
    longest = max(map(len, prompt_ids)) + max_new_tokens
    blocks = len(prompt_ids) * engine.kv_cache.allocator.blocks_for(longest)
    recorder = twin(engine, blocks, max_num_seqs=len(prompt_ids), k_policy=StaticK(0))
    requests = greedy_requests(recorder, prompt_ids, max_new_tokens)
    recorder.run_to_completion()
    return OracleProposer({tuple(r.prompt_ids): r.output_ids for r in requests})


def summary(stats, seconds: float, tokens: int) -> dict:
    stats = stats.as_dict()
    keys = ("mean_acceptance_length", "acceptance_rate_per_position", "chosen_k", "request_k")
    return {"tokens_per_s": round(tokens / seconds, 2), **{key: stats[key] for key in keys}}


def row_engine(llm, batch_size: int, longest: int, **settings) -> Engine:
    """A twin of the LLM's engine (settings: dynamic_k.twin's other arguments) for batch_size requests
    at a time, its KV cache holding batch_size requests of `longest` positions, drafts included (on a
    GPU the LLM's own pool takes most of the free memory: another like it would not fit)."""
    allocator = llm.engine.kv_cache.allocator
    num_blocks = min(batch_size * allocator.blocks_for(longest), allocator.num_blocks)
    return twin(llm.engine, num_blocks, max_num_seqs=batch_size, **settings)


@torch.inference_mode()
def roofline_fraction(llm, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
                      tokens_per_s: float, bandwidth: float) -> float:
    """What plain decoding reads per second (the weights once a step, and the batch's KV cache at
    its mean context; a step emits batch_size tokens) over the measured copy bandwidth."""
    context = sum(map(len, prompts)) / len(prompts) + max_new_tokens / 2
    step_bytes = weight_bytes(llm.model) + batch_size * context * kv_block_bytes(llm.config, llm.dtype, 1)
    return round(step_bytes * tokens_per_s / batch_size / bandwidth, 3)


def environment(llm) -> dict:
    env = {"device": device_name(llm.device),
           "device_type": llm.device.type, "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "dtype": str(llm.dtype)}
    with contextlib.suppress(ImportError):
        import transformers
        env["transformers"] = transformers.__version__
    return env


def build_parser(prog: str = "python -m nanospec.bench", doc: str = __doc__):
    """bench's flags (benchmarks/proposers.py builds on them)."""
    ap = parser(prog, doc)
    add_model_args(ap)
    add_proposer_args(ap)
    ap.add_argument("--oracle", action="store_true",
                    help="draft with the target's own greedy continuation (recorded first): every draft is "
                         "accepted, the ceiling of speculation on any model, random weights included")
    ap.add_argument("--ks", default="0",
                    help="comma-separated rows: K values (0 is plain decoding; K > 0 needs a "
                                              "proposer), 'dynamic' (dynamic K), 'dynamic-per-request'")
    ap.add_argument("--profile", metavar="PROFILE.json",
                    help="dynamic-K profile (default: the quick built-in one, measured here)")
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="measure every row N times; report the best and all N together")
    ap.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                    help="tokens every request generates")
    ap.add_argument("--categories", default="", help="comma-separated prompt categories (default: all)")
    ap.add_argument("--max-prompts", type=int, default=0, metavar="N",
                    help="use only the first N prompts, the categories taken in turn (0: all)")
    ap.add_argument("--num-requests", type=int, default=0, metavar="N",
                    help="cycle the prompts to N requests, so that large batches run full and rows run "
                         "longer (0: each prompt once)")
    ap.add_argument("--continuous", action="store_true",
                    help="queue every request at once and keep batch-size running (continuous batching), "
                         "instead of groups of batch-size run to completion one after another")
    ap.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of in the chat template")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--out", metavar="FILE.json", help="write the results as JSON there (default: no file)")
    return ap


def transformers_row(args, llm, ref, prompts, bs, k) -> dict:
    """transformers on the same prompts: plain generate() for K = 0; prompt lookup or assisted
    generation with the same K at batch size 1 (what transformers supports); nothing otherwise."""
    if k == 0:
        spec = {}
    elif bs != 1 or args.eagle or args.suffix or args.oracle:   # transformers has neither
        return {}
    elif args.ngram:
        spec = dict(prompt_lookup_num_tokens=k)
    else:
        if not hasattr(ref, "_bench_draft"):
            ref._bench_draft = transformers_model(args.draft, llm.dtype, llm.device,
                                                  llm.engine.proposer.model)
        spec = dict(assistant_model=ref._bench_draft)
        ref._bench_draft.generation_config.num_assistant_tokens = k
        ref._bench_draft.generation_config.num_assistant_tokens_schedule = "constant"
    tokens_per_s = time_transformers(ref, prompts, bs, args.max_new_tokens, llm.tokenizer.eos_ids[0], **spec)
    return {"transformers_tokens_per_s": round(tokens_per_s, 2)}


DYNAMIC_ROWS = ("dynamic", "dynamic-per-request")


def parse_ks(text: str) -> list:
    try:
        return [k.strip() if k.strip() in DYNAMIC_ROWS else int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise NanospecError("--ks takes comma-separated integers, 'dynamic' and 'dynamic-per-request', got "
                            f"{text!r}")


def dynamic_policy(args, llm, max_k: int):
    """The dynamic-K policy the dynamic rows use: from --profile, or the quick built-in profile."""
    profile = llm.dynamic_k_profile(args.profile, max_k)
    # a fresh policy per row: every row starts from the profile
    engine = llm.engine   # (run checked that dynamic rows have a proposer)
    padded = engine.use_graphs or engine.step_options.pad_batches
    return profile, lambda row, batch: DynamicK.for_proposer(profile, max_k, engine.proposer, padded, batch,
                                                             per_request=row == "dynamic-per-request")


def time_rows(llm, prompts: list[list[int]], batch_size: int, ks: list, args, new_policy, max_k: int) -> dict:
    """One repeat of every row (K, or a dynamic policy) over the prompts, the rows side by side: each
    row is an engine of its own (the same weights; its own KV cache, scheduler, statistics and
    dynamic-K policy, fresh for the repeat), and the rows take turns a step at a time, so that a
    shared machine's drift (its speed moves within minutes) hits every row alike. A row counts the
    time of its own steps only. In groups, a row queues its next group once its last one is done;
    with --continuous it queues all its requests at once."""
    rows, longest = [], max(map(len, prompts)) + args.max_new_tokens + max_k + 1   # its drafts too
    for k in ks:
        policy = new_policy(k, batch_size) if k in DYNAMIC_ROWS else StaticK(k)   # K = 0 is plain decoding
        engine = row_engine(llm, batch_size, longest, k_policy=policy,
                            proposer=getattr(args, "oracle_proposer", None) if k != 0 else None)
        rows.append({"k": k, "engine": engine, "groups": groups(prompts, batch_size, args.continuous),
                     "requests": [], "seconds": 0.0})
    while True:
        busy = 0
        for row in rows:
            engine = row["engine"]
            if not engine.scheduler.has_work() and row["groups"]:
                row["requests"] += greedy_requests(engine, row["groups"].pop(0), args.max_new_tokens)
            if engine.scheduler.has_work():
                busy += 1
                row["seconds"] += timed(llm.device, engine.step)[1]
        if not busy:
            break
    for row in rows:
        assert all(len(r.output_ids) == args.max_new_tokens for r in row["requests"])
    return {row["k"]: summary(row["engine"].stats, row["seconds"], len(row["requests"]) * args.max_new_tokens)
            for row in rows}


def check_args(args) -> tuple[list[int], list, int]:
    """The flags, before any model loads: (batch sizes, rows of K, the largest K). The speculative rows
    need a proposer; dynamic K chooses among 0..the largest static K (without one, LLM's default: 16 with
    --suffix, else DEFAULT_DYNAMIC_MAX_K)."""
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    if not batch_sizes or min(batch_sizes) < 1:
        raise NanospecError(f"--batch-sizes must be integers >= 1, got {args.batch_sizes!r}")
    ks = parse_ks(args.ks)
    if not ks or any(not isinstance(k, str) and not 0 <= k <= MAX_SPECULATIVE_TOKENS for k in ks):
        raise NanospecError(f"--ks must be K values in 0..{MAX_SPECULATIVE_TOKENS} or dynamic rows, got "
                            f"{args.ks!r}")
    check_int(args.max_new_tokens, "--max-new-tokens", low=1)
    check_int(args.repeats, "--repeats", low=1)
    check_int(args.max_prompts, "--max-prompts", low=0, fix="0 is all")
    check_int(args.num_requests, "--num-requests", low=0, fix="0 is each prompt once")
    if args.continuous and not args.no_transformers:
        raise NanospecError("--continuous has no transformers baseline (its generate() runs fixed batches); "
                            "add --no-transformers")
    if args.oracle and proposer_given(args):
        raise NanospecError("--oracle is a proposer of its own: drop --draft, --eagle, --ngram and --suffix")
    if args.oracle and any(k in DYNAMIC_ROWS for k in ks):
        raise NanospecError("--oracle rows have a fixed K: dynamic K prices the drafts of a real proposer "
                            "(--draft, --eagle, --ngram or --suffix); drop the dynamic rows from --ks")
    if any(k != 0 for k in ks) and not (proposer_given(args) or args.oracle):
        raise NanospecError(f"--ks {args.ks} has speculative rows, which need a proposer: add --draft PATH, "
                            "--eagle PATH, --ngram, --suffix or --oracle (or --ks 0 for plain decoding)")
    largest = MAX_SPECULATIVE_TOKENS if args.suffix else DEFAULT_DYNAMIC_MAX_K   # as LLM's default K
    return batch_sizes, ks, max((k for k in ks if k not in DYNAMIC_ROWS), default=0) or largest


def prompt_rows(args) -> list[dict]:
    """The shipped prompts of --categories, the categories in turn, cut to --max-prompts."""
    rows = by_category_in_turn(shipped_prompts([c for c in args.categories.split(",") if c]))
    rows = rows[:args.max_prompts] if args.max_prompts else rows
    if not rows:
        raise NanospecError(f"no shipped prompt is in --categories {args.categories!r}")
    return rows


def load(args, batch_sizes: list[int], max_k: int) -> LLM:
    return load_llm(args, max_num_seqs=max(batch_sizes), profile=None,   # (--profile is the dynamic rows')
                    num_speculative_tokens=max_k if proposer_given(args) else None)


def transformers_reference(args, llm, prompts: list[list[int]]):
    """transformers' model of the target, warmed up; None with --no-transformers or without it."""
    if args.no_transformers:
        return None
    try:
        ref = transformers_model(args.target, llm.dtype, llm.device, llm.model)
        time_transformers(ref, prompts[:2], 2, 4, pad_id=llm.tokenizer.eos_ids[0])
        return ref
    except ImportError:
        print("transformers is not installed: no baseline (pip install transformers)", file=sys.stderr)
        return None


def repeats(llm, prompts: list[list[int]], bs: int, ks: list, args, new_policy, max_k: int,
            progress: Progress) -> dict:
    """k -> every repeat's measurement at batch size bs, in order (rows side by side, so drift hits
    every K alike; each repeat starts at another row)."""
    each = {k: [] for k in ks}
    for repeat in range(args.repeats):
        order = ks[repeat % len(ks):] + ks[:repeat % len(ks)]
        timed_rows = time_rows(llm, prompts, bs, order, args, new_policy, max_k)
        progress.step(f"batch {bs}, repeat {repeat + 1}: " + ", ".join(
            f"K={k} {m['tokens_per_s']:.1f} tok/s" for k, m in timed_rows.items()))
        for k, measured in timed_rows.items():
            each[k].append(measured)
    return each


def result_row(args, llm, ref, prompts: list[list[int]], bs: int, k, each: list[dict],
               bandwidth: float) -> dict:
    """A row of the table: the fastest repeat (and the spread it hides), the roofline of a plain
    row, transformers beside a static row."""
    measured = dict(max(each, key=lambda m: m["tokens_per_s"]))   # the first of the fastest
    speeds = [m["tokens_per_s"] for m in each]
    row = {"batch_size": bs, "k": k, "nanospec_tokens_per_s": measured.pop("tokens_per_s"),
           "tokens_per_s_each_repeat": speeds,
           # every repeat generates the same tokens: all of them over all the repeats' seconds
           "tokens_per_s_all_repeats": round(len(speeds) / sum(1 / s for s in speeds), 2), **measured}
    if k in DYNAMIC_ROWS:
        row["chosen_k_each_repeat"] = [m["chosen_k"] for m in each]
    else:   # the K histograms say something only where K moves
        for key in ("chosen_k", "request_k"):
            row.pop(key)
    if k == 0:   # plain decoding against its roofline
        row["roofline_fraction"] = roofline_fraction(llm, prompts, bs, args.max_new_tokens,
                                                     row["nanospec_tokens_per_s"], bandwidth)
    if ref is not None and k not in DYNAMIC_ROWS:
        row.update(transformers_row(args, llm, ref, prompts, bs, k))
        if "transformers_tokens_per_s" in row:
            row["ratio"] = round(row["nanospec_tokens_per_s"] / row["transformers_tokens_per_s"], 3)
    return row


def profile_record(args, profile: Profile | None) -> dict | None:
    return profile and {"source": args.profile or "quick built-in profile, measured in this run",
                        "batch_sizes": profile.batch_sizes, "ks": profile.ks, "itl_s": profile.itl_s,
                        "acceptance": profile.acceptance, "drafted": profile.drafted,
                        "seconds": profile.meta.get("seconds")}


def run(args) -> dict:
    batch_sizes, ks, max_k = check_args(args)
    rows = prompt_rows(args)
    llm = load(args, batch_sizes, max_k)
    rows = [rows[i % len(rows)] for i in range(args.num_requests)] if args.num_requests else rows
    prompts = [llm.encode_prompt(r["prompt"], chat=not args.no_chat) for r in rows]
    # warm-up: the first steps' one-off costs (allocations, compiles) out of the rows
    warm_up = row_engine(llm, 2, max(map(len, prompts[:2])) + 4 + max_k + 1, k_policy=llm.engine.k_policy)
    greedy_requests(warm_up, prompts[:2], 4)
    warm_up.run_to_completion()
    args.oracle_proposer = oracle_proposer(llm.engine, prompts, args.max_new_tokens) if args.oracle else None
    dynamic = any(k in DYNAMIC_ROWS for k in ks)
    profile, new_policy = dynamic_policy(args, llm, max_k) if dynamic else (None, None)
    ref = transformers_reference(args, llm, prompts)
    bandwidth = copy_bandwidth(llm.device, 1024 if llm.device.type == "cuda" else 256)
    progress = Progress("bench", len(batch_sizes) * args.repeats)
    results = []
    for bs in batch_sizes:
        each = repeats(llm, prompts, bs, ks, args, new_policy, max_k, progress)
        results += [result_row(args, llm, ref, prompts, bs, k, each[k], bandwidth) for k in ks]
    batching = ("all queued, batch_size running (continuous batching)" if args.continuous
                else "all prompts batch_size at a time, each group run to completion")
    proposer = "oracle (the target's own greedy continuation)" if args.oracle else llm.proposer_name
    return {"benchmark": f"greedy, every request max_new_tokens long, {batching}",
            "command": "python -m nanospec.bench " + " ".join(sys.argv[1:]),
            "target": llm.target_name, "proposer": proposer,
            "categories": args.categories or "all", "num_prompts": len(prompts),
            "distinct_prompts": len(set(map(tuple, prompts))), "max_new_tokens": args.max_new_tokens,
            "chat_template": not args.no_chat, "repeats": args.repeats,
            "environment": {**environment(llm), "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1)},
            "dynamic_k_profile": profile_record(args, profile), "results": results}


def print_table(report: dict) -> None:
    """One line per row; "-" where a figure was not measured (no transformers row, one row alone).
    roofline: a plain row's bytes read per second over the device's measured copy bandwidth."""
    print(f"{report['target']} on {report['environment']['device']} ({report['environment']['dtype']}), "
          f"proposer {report['proposer']}, {report['num_prompts']} prompts ({report['categories']}), "
          f"{report['max_new_tokens']} new tokens each")
    print(f"{'batch':>6} {'K':>19} {'nanospec tok/s':>15} {'all repeats':>12} {'accept len':>11}"
          f" {'transformers tok/s':>19} {'ratio':>7} {'vs best other':>14} {'(all repeats)':>14} "
          f"{'roofline':>9}")

    def cell(value, width, digits):
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"
    for r in report["results"]:
        others = [o for o in report["results"] if o["batch_size"] == r["batch_size"] and o["k"] != r["k"]]

        def vs_best(key):
            return r[key] / max(o[key] for o in others) if others else None
        print(f"{r['batch_size']:>6} {r['k']:>19} {r['nanospec_tokens_per_s']:>15.1f} "
              f"{r['tokens_per_s_all_repeats']:>12.1f} {r['mean_acceptance_length']:>11.2f} "
              f"{cell(r.get('transformers_tokens_per_s'), 19, 1)} {cell(r.get('ratio'), 7, 2)} "
              f"{cell(vs_best('nanospec_tokens_per_s'), 14, 2)} "
              f"{cell(vs_best('tokens_per_s_all_repeats'), 14, 2)} {cell(r.get('roofline_fraction'), 9, 3)}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:   # `bench serve`: the OpenAI-API client (bench_serve.py)
        from nanospec import bench_serve
        return bench_serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    return run_command(lambda: report(args, run(args)))


def report(args, measured: dict, table=None) -> None:
    (table or print_table)(measured)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(measured, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
