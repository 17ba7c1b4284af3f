"""One command that validates a lent GPU: `python -m benchmarks.gpu_check`. A lent GPU call
lasts at most 10 minutes, and a first run on new hardware fails somewhere: so the check is a row of
sections, each bounded in time and caught on its own, and the report on disk
(bench_results/gpu_check_<device>.json, or --out) is rewritten after every section and every row of
the long ones. A kill, a hang or a crash keeps everything measured before it.

First a one-line preflight: a CUDA GPU, triton, gcc (Triton builds a C launcher at the first
launch), Python.h (the launcher includes it) and ptxas (in the triton wheel). Then the sections,
the most important figures first; each has a time budget (no new row starts once it is spent, the
first row always runs), and the whole run a deadline (FULL["seconds"]: a section that would start
after it is skipped; the CUDA tests get at most what is left):

  section            budget  what (FULL: random:llama3-8b in bfloat16)
  copy_bandwidth       20 s  a 1 GiB device-to-device copy: bytes read + written per second
  decode              150 s  plain and oracle rows (K 4, then 2) at batch 1, 16, 64, 256 with CUDA
                             graphs; K = 0 rows against their roofline. Includes loading the model
  step_anatomy         40 s  batch 1 and 16, K 0 and 4: a graph step's wall time against its
                             replays' device time; the kernels an eager step launches, per step,
                             per layer and per token (step_ops), and each kind's device time
  graphs_vs_eager      50 s  the same rows with enforce_eager, K 0 and 4: graphs over eager
  trees                40 s  oracle trees at batch 1 and 16: a tree of 2K nodes (the oracle's chain of
                             K = 4, a sibling beside each node) against the chain of K, both accepted
                             whole; with CUDA graphs and eagerly. Then a draft model's EAGLE-2 trees
                             (the small target as its own draft), graphs against eager
  attention_kernel     40 s  the tiled attention kernel alone, one layer of Llama-3.1-8B's shape:
                             KV bytes read per second at contexts 1k, 4k, 16k, batch 1 and 64, K 0, 4
  draft_vs_assisted    90 s  a draft model (random:llama3.2-1b, K = 4) against transformers'
                             assisted generation on the same weights, batch 1
  small_target         60 s  graphs against eager on random:qwen3-0.6b, where launches weigh most;
                             then its plain batch-1 step's kernels per layer
  prefill_attention    25 s  a prefill chunk's attention: tiled kernel, per-token kernel, SDPA
  host_drafting        20 s  suffix decoding's and n-gram's drafting time a step on this host's CPU
                             at each decode batch, beside the plain graph step there
  cuda_tests          330 s  `pytest -m cuda tests/` in a subprocess (4 processes with pytest-xdist):
                             the tests that need CUDA only (last: in one process they took about 320 s
                             on an H200; whatever the deadline leaves)

The deadline (480 s) leaves room for Python's start, a row that overruns its section's budget and
the summary inside the 10 minutes. Kernels (copy, attention) are timed over many launches
(triton.testing.do_bench; else CUDA events around a loop; on a CPU a perf_counter loop), never one
call between two syncs, which would time Python's launch overhead around a few-MiB read.

Oracle rows replay the target's greedy continuation. On a GPU the logits are bfloat16 and every
(batch, K, graphs) row computes them in other shapes, so near-ties flip and a continuation recorded
elsewhere is not quite this row's: each row runs, takes its own outputs as the oracle and runs
again, until its acceptance length is K + 1 or 3 tries; only the last run is timed, and the tries
and the acceptance are reported as measured.

At the end (and in the file after every section) a summary: each headline figure against its goal
(DESIGN.md), pass / fail / unmeasured; "not judged" on a reduced run. On a CPU the check runs
reduced (REDUCED: random:tiny in float32, small batches, a few tokens, the PyTorch reference
attention instead of the Triton kernels unless TRITON_INTERPRET=1): every section's code runs, and
the CUDA tests are skipped with a reason.
"""
from __future__ import annotations

import cProfile
import functools
import gc
import importlib.util
import json
import os
import pstats
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from benchmarks.measure import decoding, drafting_seconds, kernel_seconds, perturbed_window, time_copy
from benchmarks.per_token_attention import paged_attention_tokens
from benchmarks.step_ops import count_step_ops
from nanospec import kv_cache, triton_attention
from nanospec.bench import oracle_proposer, time_transformers, transformers_model, weight_bytes
from nanospec.cli import log as log_line, parser
from nanospec.dynamic_k import device_name, sync, timed, twin
from nanospec.sampling_params import SamplingParams
from nanospec.errors import NanospecError, run_command
from nanospec.k_policy import StaticK
from nanospec.llm import LLM, kv_block_bytes
from nanospec.prompts import shipped_prompts
from nanospec.proposer import NgramProposer, OracleProposer, Proposal
from nanospec.suffix import SuffixProposer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository (tests/ is there)
CUDA_TESTS = ["-m", "cuda", "tests/"]   # the tests marked @pytest.mark.cuda: those that need a GPU

# new_tokens: a multiple of every K + 1, so that an oracle row gains exactly K + 1 tokens a step.
# ks: the oracle rows' K, the headline first. Budgets in seconds (see the docstring).
FULL = dict(target="random:llama3-8b", small_target="random:qwen3-0.6b", dtype="bfloat16",
            batches=[1, 16, 64, 256], tree_batches=[1, 16],
            small_batches=[1, 16, 64], ks=[4, 2], new_tokens=60, oracle_tries=3, kv_cache_gb=2,
            assisted=("random:llama3-8b", "random:llama3.2-1b"), assisted_tokens=64, copy_megabytes=1024,
            attention=dict(contexts=[1024, 4096, 16384], batches=[1, 64], ks=[0, 4]),
            prefill=[(1, 3072, 1024), (8, 0, 512)], seconds=480, cuda_tests_timeout=330,
            budgets=dict(copy_bandwidth=20, decode=150, step_anatomy=40, graphs_vs_eager=50,
                         trees=40, attention_kernel=40,
                         draft_vs_assisted=90, cuda_tests=330, small_target=60, prefill_attention=25,
                         host_drafting=20),
            drafting=dict(index_requests=2000, context=512))
REDUCED = dict(FULL, target="random:tiny", small_target="random:tiny", dtype="float32", batches=[1, 4],
               tree_batches=[1],
               small_batches=[1], new_tokens=15, kv_cache_gb=0.05, assisted=("random:tiny", "random:tiny"),
               assisted_tokens=15, copy_megabytes=64,
               attention=dict(contexts=[256], batches=[1, 4], ks=[0, 4]),
               prefill=[(1, 96, 32), (2, 0, 32)], seconds=300, drafting=dict(index_requests=50, context=128),
               budgets={name: 60 for name in FULL["budgets"]})
START_AT_LEAST = 15   # seconds of the deadline a section needs left to start at all


# ---- helpers -------------------------------------------------------------------------------------

def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else '(no message)'}"


# ---- preflight ------------------------------------------------------------------------------------

def preflight() -> dict:
    """What the GPU path needs, each found (where) or missing (None)."""
    found = {"cuda_gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
             "triton": None, "ptxas": None, "gcc": shutil.which("gcc") or shutil.which("cc")}
    try:
        import triton
        found["triton"] = triton.__version__
        ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(
            os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        found["ptxas"] = ptxas if os.path.exists(ptxas) else None
    except Exception:   # not installed, or broken
        pass
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    found["python_h"] = header if os.path.exists(header) else None
    return found


MISSING = {"cuda_gpu": "a CUDA GPU (torch.cuda.is_available() is False)", "triton": "triton (not importable)",
           "gcc": "gcc or cc (Triton builds a C launcher at the first launch)",
           "python_h": "the Python headers (Python.h: the launcher includes it)",
           "ptxas": "ptxas (triton/backends/nvidia/bin/ptxas)"}


def preflight_line(found: dict, reduced: bool, plan: dict) -> str:
    missing = [MISSING[name] for name, where in found.items() if where is None]
    line = "preflight: " + ("missing " + "; ".join(missing) if missing else
                            f"found a CUDA GPU ({found['cuda_gpu']}), triton {found['triton']}, gcc, "
                            "Python.h, ptxas")
    if reduced:
        line += f". Runs reduced: {plan['target']} in {plan['dtype']} on the CPU, the CUDA tests skipped"
    elif missing:
        line += ". The Triton kernels will fail to build or launch"
    return line


# ---- the report and its sections ------------------------------------------------------------------

@dataclass
class Loaded:
    llm: LLM
    prompts: list[list[int]]   # distinct prompts, one per request of the largest batch
    oracle: OracleProposer     # their greedy continuations, recorded eagerly at the largest batch


class Section:
    """One section's entry in the report: its rows, saved as each comes, and its time budget."""

    def __init__(self, check: "GpuCheck", name: str, budget: float):
        self.check, self.name, self.budget, self.start = check, name, budget, time.perf_counter()
        self.entry = check.report["sections"][name] = {"budget_s": round(budget), "rows": []}

    def log(self, line: str) -> None:
        self.check.log(f"[{self.name}] {line}")

    def more(self) -> bool:
        """Whether another row may start: the first always, the next while the budget lasts."""
        rows = len(self.entry["rows"])
        if rows and time.perf_counter() - self.start >= self.budget:
            self.entry["stopped"] = f"the budget of {self.budget:.0f} s was spent after {rows} rows"
            self.log(f"stopped: {self.entry['stopped']}")
            return False
        return True

    def add(self, row: dict, line: str) -> None:
        self.entry["rows"].append(row)
        self.log(line)
        self.check.save()

    def skip(self, reason: str) -> None:
        self.entry["skipped"] = reason
        self.log(f"skipped: {reason}")


class GpuCheck:
    def __init__(self, plan: dict, reduced: bool, path: str, report: dict, log):
        self.plan, self.reduced, self.path, self.report, self.log = plan, reduced, path, report, log
        self.device = torch.device("cpu" if reduced else "cuda")
        self.cuda = not reduced
        self.start = time.perf_counter()
        self.models: dict[str, Loaded] = {}

    def save(self) -> None:
        """Rewrite the report (whole, then renamed over the old one: a kill never leaves half a file)."""
        self.report["elapsed_s"] = round(time.perf_counter() - self.start, 1)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.report, f, indent=2)
        os.replace(self.path + ".tmp", self.path)

    def seconds_left(self) -> float:
        return self.plan["seconds"] - (time.perf_counter() - self.start)

    def run(self, name: str, measure) -> None:
        """One section: started only with time left, its error caught and recorded as one line (a
        CUDA out-of-memory error too, after which every model is dropped), memory freed after it."""
        left = self.seconds_left()
        section = Section(self, name, max(0.0, min(self.plan["budgets"][name], left)))
        start = time.perf_counter()
        if left < START_AT_LEAST:
            section.skip(f"not started: {max(0, left):.0f} s were left of the run's {self.plan['seconds']} s")
        else:
            section.log(f"budget {section.budget:.0f} s")
            try:
                measure(self, section)
            except Exception as e:   # one section's failure must not lose the others
                section.entry["error"] = one_line(e)
                section.log(f"error: {section.entry['error']}")
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    section.entry["out_of_memory"] = True
                    self.models.clear()
        free_memory()   # out of the except block: the traceback's frames (and their tensors) are gone
        section.entry["seconds"] = round(time.perf_counter() - start, 1)
        self.report["summary"] = summarize(self.report)
        self.save()
        section.log(f"{section.entry['seconds']:.1f} s (run: {time.perf_counter() - self.start:.0f} s)")

    def load(self, key: str) -> Loaded:
        """plan[key]'s model (kept for the sections after it), its prompts and their oracle."""
        if key not in self.models:
            plan, start = self.plan, time.perf_counter()
            # the LLM's own engine only records the oracle's continuations: no graphs of its own
            llm = LLM(plan[key], device=str(self.device), dtype=plan["dtype"],
                      max_num_seqs=max(plan["batches"]), kv_cache_gb=plan["kv_cache_gb"], enforce_eager=True)
            texts = [row["prompt"] for row in shipped_prompts()]
            # distinct prompts (a numbered copy where texts repeat), so that each has one continuation
            prompts = [llm.encode_prompt(f"{i}. {texts[i % len(texts)]}")[:64]
                       for i in range(max(plan["batches"]))]
            oracle = oracle_proposer(llm.engine, prompts, plan["new_tokens"] + max(plan["ks"]) + 1)
            self.models[key] = Loaded(llm, prompts, oracle)
            self.log(f"loaded {plan[key]} and recorded its greedy continuations in "
                     f"{time.perf_counter() - start:.1f} s")
        return self.models[key]

    def drop(self, keys) -> None:
        for key in keys:
            self.models.pop(key, None)
        free_memory()


# ---- decode rows ----------------------------------------------------------------------------------

def run_once(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy decoding of the prompts at once; the decode steps' seconds (the first one untimed: a
    proposer's catch-up, graphs of sampling steps), acceptance over the run, and the outputs."""
    stats = engine.stats
    accepted, request_steps = stats.accepted_tokens, stats.request_steps
    requests = decoding(engine, prompts, new_tokens)
    untimed = sum(len(r.output_ids) for r in requests)
    seconds, steps = 0.0, 0
    while engine.scheduler.has_work():
        seconds += timed(engine.device, engine.step)[1]
        steps += 1
    # acceptance length: 1 + accepted drafts per request and step (engine.Stats), over this run
    acceptance = 1 + (stats.accepted_tokens - accepted) / max(1, stats.request_steps - request_steps)
    return {"seconds": seconds, "steps": steps, "tokens": len(prompts) * new_tokens - untimed,
            "acceptance": round(acceptance, 4),
            "outputs": {tuple(r.prompt_ids): r.output_ids for r in requests}}


class OracleTreeProposer(OracleProposer):
    """Trees of the oracle's chain of `depth` drafts (nodes 1 .. depth) and a sibling beside each chain
    node (a token the oracle does not draft there), tried after it: 2 * depth nodes, the chain accepted
    whole, as the oracle chain of `depth` is. The tree's tokens/s over that chain's is what verifying
    `depth` more nodes costs. A request allowed fewer nodes (near its end) loses siblings first."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], depth: int):
        super().__init__(continuations)
        self.depth = depth

    def propose(self, requests, ks) -> Proposal:
        chains = super().propose(requests, [min(self.depth, k) for k in ks]).host_drafts
        siblings = [min(len(chain), k - len(chain)) for chain, k in zip(chains, ks)]
        drafts = [chain + [t - 1 if t else 1 for t in chain[:n]] for chain, n in zip(chains, siblings)]
        parents = [[-1, *range(len(chain)), *range(n)] for chain, n in zip(chains, siblings)]
        return Proposal([len(d) for d in drafts], drafts, parents=parents)


def row_engine(loaded: Loaded, batch: int, k: int, graphs: bool, new_tokens: int, tree: bool = False):
    """An engine of its own for a row: `batch` of the prompts, K = k drafts by the oracle (a copy
    of it, this row's own; with `tree`, OracleTreeProposer's trees of k nodes), CUDA graphs or not,
    its greedy verify graphs captured (a tree step's on its first use)."""
    prompts = loaded.prompts[:batch]
    longest = max(map(len, prompts)) + new_tokens + k + 1
    blocks = batch * loaded.llm.engine.kv_cache.allocator.blocks_for(longest)
    continuations = dict(loaded.oracle.continuations)   # this row's own copy
    oracle = None if not k else (OracleTreeProposer(continuations, k // 2) if tree
                                 else OracleProposer(continuations))
    engine = twin(loaded.llm.engine, blocks, max_num_seqs=batch, k_policy=StaticK(k), proposer=oracle,
                                    use_graphs=graphs)
    if not tree:
        engine.step_graphs.capture_all([k])
    return engine, prompts, oracle


def decode_row(loaded: Loaded, batch: int, k: int, graphs: bool, plan: dict, tree: bool = False) -> dict:
    """Greedy decoding of `batch` prompts on an engine of their own (K = k drafts by the oracle, a
    tree of k nodes with `tree`; CUDA graphs or not). An oracle row whose acceptance is below its
    chain's length + 1 takes this very configuration's outputs as its oracle and runs again, up to
    plan["oracle_tries"] runs; the last is timed."""
    new_tokens, depth = plan["new_tokens"], k // 2 if tree else k
    engine, prompts, oracle = row_engine(loaded, batch, k, graphs, new_tokens, tree)
    tries = []
    while True:
        run = run_once(engine, prompts, new_tokens)
        tries.append(run["acceptance"])
        if not k or run["acceptance"] >= depth + 1 or len(tries) == plan["oracle_tries"]:
            break
        oracle.continuations.update(run["outputs"])
    return {"batch": batch, "k": k, "tree": tree, "graphs": engine.step_graphs.use_graphs,
            "step_ms": round(1000 * run["seconds"] / max(1, run["steps"]), 3),
            "tokens_per_s": round(run["tokens"] / run["seconds"], 2) if run["seconds"] else None,
            "mean_acceptance_length": run["acceptance"], "oracle_tries": len(tries),
            "acceptance_each_try": tries}


def row_line(row: dict, seconds: float) -> str:
    tries = f" ({row['oracle_tries']} {'try' if row['oracle_tries'] == 1 else 'tries'})" if row["k"] else ""
    return (f"batch {row['batch']:>3} K {row['k']} {'graphs' if row['graphs'] else 'eager '}: "
            f"{row['tokens_per_s']} tok/s, step {row['step_ms']:.2f} ms, acceptance "
            f"{row['mean_acceptance_length']:.2f}{tries} [{seconds:.1f} s]")


def measure_row(check: GpuCheck, key: str, batch: int, k: int, graphs: bool, tree: bool = False) -> dict:
    start = time.perf_counter()
    row = decode_row(check.load(key), batch, k, graphs, check.plan, tree)
    free_memory()   # the row's engine: its KV pool and graphs
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(name) == value for name, value in match.items())), None)


def copy_gb_s(report: dict) -> float | None:
    rows = report["sections"].get("copy_bandwidth", {}).get("rows")
    return rows[0]["gb_s"] if rows else None


def add_roofline(check: GpuCheck, row: dict) -> None:
    """A plain row's bytes read per step (the weights once, the batch's KV cache at its mean
    context) per second over the measured copy bandwidth."""
    loaded, bandwidth = check.load("target"), copy_gb_s(check.report)
    context = sum(map(len, loaded.prompts[:row["batch"]])) / row["batch"] + check.plan["new_tokens"] / 2
    llm = loaded.llm
    row["bytes_per_step"] = int(weight_bytes(llm.model) + row["batch"] * context
                                * kv_block_bytes(llm.config, llm.dtype, 1))
    if bandwidth and row["step_ms"]:
        row["fraction_of_copy_bandwidth"] = round(row["bytes_per_step"] / (row["step_ms"] / 1000) / bandwidth
                                                  / 1e9, 3)


def measure_decode(check: GpuCheck, section: Section) -> None:
    """Plain and oracle rows with CUDA graphs: K 0 and the headline K at every batch, then the other
    K's; an oracle row's speedup over the plain row of its batch."""
    plan, rows = check.plan, section.entry["rows"]
    first, *others = plan["ks"]
    for batch, k in [(b, k) for b in plan["batches"] for k in (0, first)] + \
                    [(b, k) for k in others for b in plan["batches"]]:
        if not section.more():
            return
        row = measure_row(check, "target", batch, k, graphs=check.cuda)
        plain = find(rows, batch=batch, k=0)
        if k == 0:
            add_roofline(check, row)
        elif plain and plain["tokens_per_s"] and row["tokens_per_s"]:
            row["speedup_vs_plain"] = round(row["tokens_per_s"] / plain["tokens_per_s"], 3)
        section.add(row,
                    row_line(row, row["seconds"])
                    + (f", {row.get('speedup_vs_plain')}x plain" if k
                       else f", {row.get('fraction_of_copy_bandwidth')} of " "copy bw"))


def compare_graphs(check: GpuCheck, section: Section, key: str, batch: int, k: int,
                   graph_row: dict | None) -> None:
    """The same row with CUDA graphs (measured here unless given) and eagerly: their ratio."""
    if graph_row is None:
        graph_row = measure_row(check, key, batch, k, graphs=check.cuda)
        section.log(row_line(graph_row, graph_row["seconds"]))
    eager = measure_row(check, key, batch, k, graphs=False)
    ratio = round(graph_row["tokens_per_s"] / eager["tokens_per_s"], 3) \
        if graph_row["tokens_per_s"] and eager["tokens_per_s"] else None
    row = {"target": check.plan[key], "batch": batch, "k": k,
           "graphs_tokens_per_s": graph_row["tokens_per_s"],
           "eager_tokens_per_s": eager["tokens_per_s"], "graphs_over_eager": ratio,
           "graphs": graph_row["graphs"],
           "graphs_step_ms": graph_row["step_ms"], "eager_step_ms": eager["step_ms"],
           "eager_mean_acceptance_length": eager["mean_acceptance_length"],
           "eager_oracle_tries": eager["oracle_tries"]}
    if not check.cuda:
        row["note"] = "no CUDA: both rows run eagerly"
    section.add(row, row_line(eager, eager["seconds"]) + f"; graphs / eager {ratio}")


def measure_graphs_vs_eager(check: GpuCheck, section: Section) -> None:
    """The target's rows eagerly (enforce_eager) at K 0 and the headline K, against the decode
    section's graph rows (measured here where that section did not reach them)."""
    graph_rows = check.report["sections"].get("decode", {}).get("rows", [])
    for batch in check.plan["batches"]:
        for k in (0, check.plan["ks"][0]):
            if not section.more():
                return
            compare_graphs(check, section, "target", batch, k,
                           find(graph_rows, batch=batch, k=k, graphs=check.cuda))


def measure_trees(check: GpuCheck, section: Section) -> None:
    """Oracle trees against oracle chains of the headline K, side by side at each tree batch, with CUDA
    graphs and eagerly: a tree of 2K nodes (OracleTreeProposer) accepts what the chain of K does, so
    tree / chain is what verifying K more nodes costs, and the tree rows' graphs / eager what a tree
    step's graph saves."""
    k = check.plan["ks"][0]
    for batch in check.plan["tree_batches"]:
        for graphs in (True, False) if check.cuda else (False,):
            if not section.more():
                return
            chain = measure_row(check, "target", batch, k, graphs)
            tree = measure_row(check, "target", batch, 2 * k, graphs, tree=True)
            row = {"batch": batch, "graphs": tree["graphs"], "chain": chain, "tree": tree,
                   "tree_over_chain": round(tree["tokens_per_s"] / chain["tokens_per_s"], 3)
                   if tree["tokens_per_s"] and chain["tokens_per_s"] else None}
            section.add(row, f"{row_line(chain, chain['seconds'])}\n  tree of {2 * k} nodes: "
                        f"{row_line(tree, tree['seconds'])}; tree / chain {row['tree_over_chain']}")
    for graphs in (True, False) if check.cuda else (False,):
        if not section.more():
            return
        row = drafter_tree_row(check, graphs)
        free_memory()   # the row's LLM
        section.add(row, f"{row['drafter']}'s trees {'graphs' if row['graphs'] else 'eager '}: "
                         f"{row['tokens_per_s']} tok/s, acceptance {row['mean_acceptance_length']:.2f}")


def drafter_tree_row(check: GpuCheck, graphs: bool) -> dict:
    """EAGLE-2 trees of a draft model (3 children a node, 3 deep, 6 nodes), the small target as its own
    draft (so the tree's greedy path is accepted), batch 1, with CUDA graphs (the verify, and the tree
    round's later depths and rerank: StepGraphs.tree_body) or eagerly."""
    plan, small = check.plan, check.plan["small_target"]
    llm = LLM(small, draft=small, num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3,
              device=str(check.device), dtype=plan["dtype"], max_num_seqs=1, kv_cache_gb=plan["kv_cache_gb"],
              enforce_eager=not graphs)
    prompt = llm.encode_prompt(shipped_prompts()[0]["prompt"])[:64]
    params = SamplingParams(temperature=0, max_tokens=plan["new_tokens"], ignore_eos=True)
    llm.generate([prompt], params)   # warm-up: graphs, compiles
    seconds = timed(check.device, lambda: llm.generate([prompt], params))[1]
    graphed = llm.engine.step_graphs.use_graphs
    return {"drafter": f"{small} as its own draft", "batch": 1, "k": 6, "graphs": graphed,
            "tokens_per_s": round(plan["new_tokens"] / seconds, 2),
            "mean_acceptance_length": llm.stats["mean_acceptance_length"]}


def measure_small_target(check: GpuCheck, section: Section) -> None:
    """Graphs against eager on the small target, where launch overhead weighs most; then its
    plain batch-1 step's operations (step_ops, eagerly: under a graph each is a node)."""
    for batch in check.plan["small_batches"]:
        for k in (0, check.plan["ks"][0]):
            if not section.more():
                return
            compare_graphs(check, section, "small_target", batch, k, None)
    if section.more():
        loaded, new_tokens = check.load("small_target"), check.plan["new_tokens"]
        engine, prompts, _ = row_engine(loaded, 1, 0, False, new_tokens)
        decoding(engine, prompts, new_tokens)
        ops = count_step_ops(engine, max(1, min(8, new_tokens - 7))).as_dict()
        section.add({"operations_of": "batch 1, K 0, eager", "ops": ops}, f"batch   1 K 0: {ops_text(ops)}")


def ops_text(ops: dict) -> str:
    """An eager step's operations (StepOps.as_dict) in a log line."""
    return (f"{ops['per_step']:.0f} ops a step, {ops['per_layer']:.1f} a layer, "
            f"{ops['outside_layers']:.0f} outside the layers")


def replay_device_ms(engine, steps: int) -> tuple[float, float]:
    """(wall ms per step, device ms per step of its graph replays): CUDA events around every replay;
    the difference is host work the device waits for."""
    graphs, real = engine.step_graphs, engine.step_graphs.replay
    marks = []

    def replay(key, width):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real(key, width)
        end.record()
        marks.append((start, end))
        return out
    graphs.replay = replay
    try:
        seconds = sum(timed(engine.device, engine.step)[1] for _ in range(steps))
    finally:
        del graphs.replay
    torch.cuda.synchronize()
    return 1000 * seconds / steps, sum(a.elapsed_time(b) for a, b in marks) / steps


def host_profile(engine, steps: int, top: int = 12) -> dict:
    """Where a step's host time goes: cProfile over `steps` steps, the functions of most own time
    (microseconds per step; cProfile's own cost inflates them alike). On CUDA the wait for the
    device shows up in whatever reads the results back."""
    profiler = cProfile.Profile()
    sync(engine.device)
    profiler.enable()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    profiler.disable()
    # (file, line, name) -> (calls, primitive, own s, cumulative s, callers)
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {f"{os.path.basename(file)}:{line}({name})": round(1e6 * own / steps, 1)
            for (file, line, name), (_, _, own, _, _) in rows}


def measure_step_anatomy(check: GpuCheck, section: Section) -> None:
    """Where a decode step goes, at the first two batches (1 and 16), K 0 and the headline K: with
    graphs, the step's wall time against its graph replays' device time; eagerly, the operations
    it launches (step_ops: kernels per step, per decoder layer, per token; under a graph each is a
    node) and the device time of each kind."""
    loaded, plan = check.load("target"), check.plan
    new_tokens = plan["new_tokens"]   # the oracle's length
    for batch in plan["batches"][:2]:
        for k in (0, plan["ks"][0]):
            if not section.more():
                return
            # all inside the requests' tokens, twice over (the host profile, then the timed replays)
            steps = max(1, min(8, (new_tokens - 7) // (2 * (k + 1))))
            row = {"batch": batch, "k": k}
            for graphs in [True, False] if check.cuda else [False]:   # an engine of its own each
                engine, prompts, _ = row_engine(loaded, batch, k, graphs, new_tokens)
                decoding(engine, prompts, new_tokens)
                if graphs or not check.cuda:
                    row["host_us_per_step"] = host_profile(engine, steps)
                if graphs:
                    row["graphs_step_ms"], row["replay_device_ms"] = (
                        round(ms, 3) for ms in replay_device_ms(engine, steps))
                else:
                    row["eager"] = count_step_ops(engine, steps).as_dict()
                del engine
                free_memory()
            eager = row["eager"]
            section.add(row, f"batch {batch:>3} K {k}: " + (
                f"graphs step {row['graphs_step_ms']:.2f} ms, replays {row['replay_device_ms']:.2f} ms on "
                "the device; " if check.cuda else "")
                        + f"{ops_text(eager)}, {eager['per_token']:.0f} a token")


# ---- kernels alone --------------------------------------------------------------------------------

def llama8b_layer(device: torch.device, dtype: torch.dtype, batch: int, cached: int, new: int,
                  block_size: int = 16):
    """One attention layer of Llama-3.1-8B's shape (32 query heads, 8 KV heads, head_dim 128) over
    random pages: batch sequences of `cached` tokens adding `new` each. Returns (q, kv, meta), kv the
    layer's pages [2, blocks, block_size, 8, 128]."""
    per_seq = (cached + new) // block_size + 1
    cache = kv_cache.KVCache(1, batch * per_seq, block_size, 8, 128, dtype, device)
    cache.pool.normal_()
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    meta = kv_cache.build_metadata(tables, [cached] * batch, [new] * batch, block_size, device)
    return torch.randn(batch * new, 32, 128, dtype=dtype, device=device), cache.layer(0), meta


def attention_kernels(device: torch.device, prefill: bool) -> dict:
    """name -> attention(q, kv, meta): the Triton kernels where they run (CUDA, or a
    CPU under TRITON_INTERPRET=1), the PyTorch reference (SDPA over gathered pages) always."""
    scale = 128 ** -0.5
    kernels = {}
    if triton_attention.triton is not None and (device.type == "cuda"
                                                or os.environ.get("TRITON_INTERPRET") == "1"):
        kernels["tiled"] = lambda q, kv, meta: triton_attention.paged_attention(q, *kv, meta, scale)
        if prefill:
            kernels["per_token"] = lambda q, kv, meta: paged_attention_tokens(
                q, *kv, meta.block_tables, meta.token_seq, meta.positions, scale)
    if prefill or not kernels:
        kernels["sdpa_gathered"] = lambda q, kv, meta: kv_cache.paged_attention_reference(q, kv, meta, scale)
    return kernels


def measure_copy_bandwidth(check: GpuCheck, section: Section) -> None:
    megabytes = check.plan["copy_megabytes"]
    bandwidth, timer = time_copy(check.device, megabytes)
    row = {"megabytes": megabytes, "gb_s": round(bandwidth / 1e9, 1), "timer": timer}
    section.add(row, f"{row['gb_s']} GB/s (read + written, {megabytes} MiB, {timer})")


def measure_attention(check: GpuCheck, section: Section) -> None:
    """The decode/verify attention alone, one layer of Llama-3.1-8B's shape: KV bytes read per second."""
    plan, dtype = check.plan["attention"], getattr(torch, check.plan["dtype"])
    (name, attention), = attention_kernels(check.device, prefill=False).items()
    bandwidth = copy_gb_s(check.report)
    for context in plan["contexts"]:
        for batch in plan["batches"]:
            for k in plan["ks"]:
                if not section.more():
                    return
                q, kv, meta = llama8b_layer(check.device, dtype, batch, context - k - 1, k + 1)
                seconds, timer = kernel_seconds(check.device, functools.partial(attention, q, kv, meta))
                kv_gb_s = batch * context * 2 * 8 * 128 * kv.element_size() / seconds / 1e9
                row = {"kernel": name, "context": context, "batch": batch, "k": k,
                       "us": round(1e6 * seconds, 1), "kv_gb_s": round(kv_gb_s, 1), "timer": timer,
                       "fraction_of_copy_bandwidth": round(kv_gb_s / bandwidth, 3) if bandwidth else None}
                del q, kv, meta
                free_memory()
                section.add(row,
                            f"{name} context {context} batch {batch} K {k}: {row['us']} us, {row['kv_gb_s']} "
                            "GB/s")


def measure_prefill(check: GpuCheck, section: Section) -> None:
    """A prefill chunk's attention, one layer of Llama-3.1-8B's shape, by each candidate."""
    dtype = getattr(torch, check.plan["dtype"])
    kernels = attention_kernels(check.device, prefill=True)
    for batch, cached, new in check.plan["prefill"]:
        if not section.more():
            return
        q, kv, meta = llama8b_layer(check.device, dtype, batch, cached, new)
        row = {"batch": batch, "cached": cached, "new": new}
        for name, attention in kernels.items():
            seconds, row["timer"] = kernel_seconds(check.device, functools.partial(attention, q, kv, meta), 5)
            row[f"{name}_ms"] = round(1000 * seconds, 3)
        del q, kv, meta
        free_memory()
        section.add(row, f"batch {batch}, {cached} cached + {new} new: "
                    + ", ".join(f"{name} {row[f'{name}_ms']} ms" for name in kernels))


# ---- against transformers -------------------------------------------------------------------------

def measure_assisted(check: GpuCheck, section: Section) -> None:
    """nanospec with a draft model against transformers' assisted generation, both on the same
    random target and draft weights (greedy, batch 1, K = 4): tokens/s and their ratio."""
    if importlib.util.find_spec("transformers") is None:
        return section.skip("transformers is not installed (pip install transformers)")
    plan, device = check.plan, check.device
    (target, draft), tokens = plan["assisted"], plan["assisted_tokens"]
    llm = LLM(target, draft=draft, num_speculative_tokens=4, device=str(device), dtype=plan["dtype"],
              max_num_seqs=1, kv_cache_gb=plan["kv_cache_gb"])
    prompt = llm.encode_prompt(shipped_prompts()[0]["prompt"])[:64]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)   # warm-up: graphs, compiles
    ours = tokens / timed(device, lambda: llm.generate([prompt], params))[1]
    acceptance = llm.stats["mean_acceptance_length"]
    ref = transformers_model(target, llm.dtype, device, llm.model)
    assistant = transformers_model(draft, llm.dtype, device, llm.engine.proposer.model)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    pad = llm.tokenizer.eos_ids[0]
    time_transformers(ref, [prompt], 1, 4, pad, assistant_model=assistant)   # warm-up
    theirs = time_transformers(ref, [prompt], 1, tokens, pad, assistant_model=assistant)
    row = {"target": target, "draft": draft, "k": 4, "batch": 1, "new_tokens": tokens,
           "nanospec_tokens_per_s": round(ours, 2), "mean_acceptance_length": acceptance,
           "transformers_tokens_per_s": round(theirs, 2), "ratio": round(ours / theirs, 3)}
    section.add(row,
                f"nanospec {row['nanospec_tokens_per_s']} tok/s (acceptance {acceptance:.2f}), transformers "
                     f"{row['transformers_tokens_per_s']} tok/s: {row['ratio']}x")


# ---- the CUDA tests -------------------------------------------------------------------------------

def read_pytest(output: str) -> dict:
    """Counts from pytest -v's output: its last summary line, or (a run cut off before it) the
    per-test lines; the failures' one-line summaries."""
    lines = output.strip().splitlines()
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.match(r"=+ .*\d+ \w+.* in [\d.]+s", line)), None)
    if summary:
        counts = {word: int(n) for n,
                  word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)}
    else:
        # "file::test PASSED", or under pytest-xdist "[gw0] [ 50%] PASSED file::test"
        words = "(PASSED|FAILED|SKIPPED|ERROR)"
        results = [a or b for a, b in re.findall(rf"::\S+ {words}|\] {words} \S+::", output)]
        counts = {word.lower(): results.count(word) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")
                  if word in results}
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:20]
    return {"summary": summary, **counts, "failures": failures}


def run_cuda_tests(check: GpuCheck, section: Section) -> None:
    """pytest -m cuda tests/ in a subprocess of its own session, bounded by the section's time
    (what is left of the run, at most plan["cuda_tests_timeout"]); a timeout is recorded, with the
    tests finished by then. pytest's whole output goes beside the report (<report>_cuda_tests.log)."""
    # in 4 processes where pytest-xdist is there (the GPU image has it): each test makes small models of
    # its own, and one process leaves the GPU idle while it compiles and captures
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "--durations=20",
               *workers, *CUDA_TESTS]
    shown = "python -m pytest -v " + " ".join(workers + CUDA_TESTS)
    if not check.cuda:
        return section.skip(f"no CUDA GPU: every test `{shown}` selects would skip here (CI runs the others)")
    if not os.path.isdir(os.path.join(ROOT, "tests")):
        return section.skip(f"no tests/ folder beside the package ({ROOT})")
    timeout = max(1.0, min(check.plan["cuda_tests_timeout"], section.budget))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:   # a file, not a pipe: compile workers may outlive pytest
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            returncode, timed_out = proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)   # pytest and what it started (its session)
            returncode, timed_out = proc.wait(), True
        out.seek(0)
        output = out.read()
    with open(os.path.splitext(check.path)[0] + "_cuda_tests.log", "w") as f:
        f.write(output)
    row = {"command": shown, "returncode": returncode, "timed_out": timed_out, "timeout_s": round(timeout),
           "seconds": round(time.perf_counter() - start, 1), **read_pytest(output)}
    if timed_out:
        row["summary"] = f"timed out after {timeout:.0f} s"
    if returncode or timed_out:
        row["tail"] = output[-3000:]
    counts = ", ".join(f"{row[w]} {w}" for w in ("passed", "failed", "skipped", "error",
                                                 "errors") if row.get(w))
    section.add(row, f"{row['summary']} ({counts or 'no test finished'}) [{row['seconds']} s]")


# ---- the summary ----------------------------------------------------------------------------------

def figure(name: str, value, goal: float | None, goal_text: str, reduced: bool, why: str, detail: str = "",
           at_most: bool = False) -> dict:
    """One summary row: value against goal (at least it; with at_most, at most it)."""
    if value is None:
        status = "unmeasured"
    elif reduced:
        status = "not judged (reduced run)"
    else:
        status = "pass" if (value <= goal if at_most else value >= goal) else "fail"
    return {"figure": name, "value": value, "goal": goal_text, "status": status,
            "detail": detail if value is not None else why}


def why_missing(report: dict, name: str) -> str:
    entry = report["sections"].get(name)
    if entry is None:
        return f"section {name} has not run"
    return (entry.get("error") or entry.get("skipped") or entry.get("stopped")
            or f"section {name} has no such row")


def summarize(report: dict) -> list[dict]:
    """Each headline figure against its goal (DESIGN.md's targets; our own bar where it sets none)."""
    rows = {name: entry.get("rows", []) for name, entry in report["sections"].items()}
    return [*decode_figures(report, rows), *tree_figures(report, rows), *kernel_figures(report, rows)]


def decode_figures(report: dict, rows: dict) -> list[dict]:
    """Plain and oracle decoding against the roofline, CUDA graphs against eager."""
    reduced, cuda = report["mode"] != "full", report["mode"] == "full"
    plain = find(rows.get("decode", []), batch=1, k=0, graphs=cuda)
    oracle = find(rows.get("decode", []), batch=1, k=4, graphs=cuda)
    batches = sorted({r["batch"] for r in rows.get("graphs_vs_eager", []) if r["k"] == 0})
    graphs_1 = find(rows.get("graphs_vs_eager", []), batch=1, k=0)
    graphs_n = find(rows.get("graphs_vs_eager", []), batch=batches[-1], k=0) if len(batches) > 1 else None
    small = find(rows.get("small_target", []), batch=1, k=0)
    target = report["target"]
    return [
        figure(f"plain decoding, {target}, batch 1: bytes read per second / copy bandwidth",
               plain and plain.get("fraction_of_copy_bandwidth"), 0.8, ">= 0.8", reduced,
               why_missing(report, "decode" if not plain else "copy_bandwidth"),
               plain and f"{plain['tokens_per_s']} tok/s, step {plain['step_ms']} ms"),
        figure(f"oracle K = 4, {target}, batch 1: speedup over plain",
               oracle and oracle.get("speedup_vs_plain"), 4.0, ">= 4", reduced, why_missing(report, "decode"),
               oracle
               and f"acceptance {oracle['mean_acceptance_length']} (oracle runs: {oracle['oracle_tries']})"),
        figure(f"CUDA graphs / eager, {target}, batch 1, K 0", graphs_1 and graphs_1["graphs_over_eager"],
               1.0, ">= 1 (graphs never slower)", reduced, why_missing(report, "graphs_vs_eager"),
               graphs_1 and f"step {graphs_1['graphs_step_ms']} ms against {graphs_1['eager_step_ms']} ms"),
        figure(f"CUDA graphs / eager, {target}, batch {batches[-1] if len(batches) > 1 else 'above 1'}, K 0",
               graphs_n and graphs_n["graphs_over_eager"], 1.0, ">= 1 (graphs never slower)", reduced,
               why_missing(report, "graphs_vs_eager"),
               graphs_n and f"step {graphs_n['graphs_step_ms']} ms against {graphs_n['eager_step_ms']} ms"),
        figure(f"CUDA graphs / eager, small target {report['small_target']}, batch 1, K 0",
               small and small["graphs_over_eager"],
               1.0, ">= 1 (graphs never slower)", reduced, why_missing(report, "small_target"),
               small and f"step {small['graphs_step_ms']} ms against {small['eager_step_ms']} ms"),
    ]


def tree_figures(report: dict, rows: dict) -> list[dict]:
    """Oracle trees at batch 1: against the chain they contain, and with CUDA graphs against eagerly."""
    reduced, cuda = report["mode"] != "full", report["mode"] == "full"
    graphed, eager = (find(rows.get("trees", []), batch=1, graphs=g, drafter=None) for g in (cuda, False))
    tree, chain = (graphed or {}).get("tree"), (graphed or {}).get("chain")
    ratio = cuda and eager and tree and round(tree["tokens_per_s"] / eager["tree"]["tokens_per_s"], 3)
    nodes = tree and tree["k"]
    drafted = [next((r for r in rows.get("trees", []) if r.get("drafter") and r["graphs"] == g), None)
               for g in (True, False)]
    drafted_ratio = all(drafted) and round(drafted[0]["tokens_per_s"] / drafted[1]["tokens_per_s"], 3)
    return [
        figure(f"oracle tree of {nodes or '2K'} nodes / its oracle chain, {report['target']}, batch 1",
               graphed and graphed["tree_over_chain"], 0.9, ">= 0.9 (our bar; issue 64 sets none on a GPU)",
               reduced, why_missing(report, "trees"),
               tree and f"{tree['tokens_per_s']} against {chain['tokens_per_s']} tok/s, acceptance "
                        f"{tree['mean_acceptance_length']} against {chain['mean_acceptance_length']}"),
        figure(f"CUDA graphs / eager, oracle tree of {nodes or '2K'} nodes, batch 1", ratio or None, 1.0,
               ">= 1 (graphs never slower)", reduced, why_missing(report, "trees"),
               ratio and f"step {tree['step_ms']} ms against {eager['tree']['step_ms']} ms"),
        figure(f"CUDA graphs / eager, a draft model's EAGLE-2 trees ({report['small_target']}), batch 1",
               drafted_ratio or None, 1.0, ">= 1 (graphs never slower)", reduced,
               why_missing(report, "trees"),
               drafted_ratio and f"{drafted[0]['tokens_per_s']} against {drafted[1]['tokens_per_s']} tok/s"),
    ]


def kernel_figures(report: dict, rows: dict) -> list[dict]:
    """The attention kernel alone, a draft model against transformers, operations a decode layer."""
    reduced, cuda = report["mode"] != "full", report["mode"] == "full"
    kernel = max((r for r in rows.get("attention_kernel", []) if r["k"] == 0),
                 key=lambda r: r["context"] * r["batch"], default=None)
    assisted = next(iter(rows.get("draft_vs_assisted", [])), None)
    anatomy = find(rows.get("step_anatomy", []), batch=1, k=0)
    small_ops = next((r["ops"] for r in rows.get("small_target", []) if "ops" in r), None)
    target = report["target"]
    return [
        figure("attention kernel alone: KV bytes read per second / copy bandwidth",
               kernel and kernel["fraction_of_copy_bandwidth"], 0.5, ">= 0.5 (our bar; DESIGN.md sets none)",
               reduced, why_missing(report, "attention_kernel" if not kernel else "copy_bandwidth"),
               kernel and f"{kernel['kv_gb_s']} GB/s ({kernel['kernel']}, context {kernel['context']}, "
                          f"batch {kernel['batch']}, K 0)"),
        figure("draft model / transformers' assisted generation (tokens/s, batch 1, K 4)",
               assisted and assisted["ratio"], 3.0 if cuda else 1.5,
               ">= 3 on a GPU" if cuda else ">= 1.5 on a CPU",
               reduced, why_missing(report, "draft_vs_assisted"),
               assisted
               and f"{assisted['nanospec_tokens_per_s']} against {assisted['transformers_tokens_per_s']} "
                            f"tok/s, acceptance {assisted['mean_acceptance_length']}"),
        *(figure(f"operations a decode layer, {name}, plain, batch 1 (on a GPU: kernels, a graph's nodes)",
                 ops and ops["per_layer"], 15, "<= 15", reduced, why_missing(report, section),
                 ops and f"{ops['per_step']:.0f} a step, {ops['outside_layers']:.0f} outside the layers",
                 at_most=True)
          for name, section, ops in ((target, "step_anatomy", anatomy and anatomy["eager"]),
                                     (f"small target {report['small_target']}", "small_target", small_ops))),
    ]


def summary_lines(summary: list[dict]) -> list[str]:
    width = max(len(f["figure"]) for f in summary)
    lines = [f"{'summary':<{width}}  {'value':>7}  {'goal':<12}  status"]
    for f in summary:
        value = "-" if f["value"] is None else f"{f['value']:.3g}"
        goal = f["goal"].split(" (")[0]
        lines.append(f"{f['figure']:<{width}}  {value:>7}  {goal:<12}  {f['status']}: {f['detail']}")
    return lines


# ---- the host's drafting ---------------------------------------------------------------------------

def measure_host_drafting(check: GpuCheck, section: Section) -> None:
    """What the host proposers cost a step on this machine's CPU, next to the target's plain graph
    step at the same batch (the decode section's rows): a step waits for its drafts, so where they
    take longer than the step the GPU idles. Suffix decoding (K 16, its global index holding earlier
    requests) and n-gram (K 4) draft for every request of the batch, over word-level token streams of
    the shipped prompts (real text's repeats, no tokenizer needed), each request a token longer each
    step; the median of 3 steps. As benchmarks/suffix_costs.py (there with the model's tokens), one token
    in 8 of every window is replaced at random, so that no two requests are alike."""
    plan = check.plan["drafting"]
    ids: dict[str, int] = {}
    corpus = [ids.setdefault(word, len(ids)) for row in shipped_prompts() for word in row["prompt"].split()]
    rng = random.Random(0)
    window = functools.partial(perturbed_window, corpus, rng=rng, vocab=50_000)
    suffix = SuffixProposer(None, max_spec_offset=0)
    for _ in range(plan["index_requests"]):
        suffix.global_index.add(window(400))
    steps = {r["batch"]: r["step_ms"] for r in check.report["sections"].get("decode", {}).get("rows", [])
             if r["k"] == 0}
    for batch in check.plan["batches"]:
        if not section.more():
            return
        row = {"batch": batch, "index_requests": plan["index_requests"], "context": plan["context"]}
        for name, proposer, k in (("suffix", suffix, 16), ("ngram", NgramProposer(None), 4)):
            requests = [SimpleNamespace(tokens=window(plan["context"]), suffix_stream=None,
                                        proposer_state=None)
                        for _ in range(batch)]
            seconds = drafting_seconds(proposer, requests, k, lambda: rng.choice(corpus), repeats=3)
            row[f"{name}_ms"] = round(1000 * seconds, 3)
        row["plain_step_ms"] = steps.get(batch)
        section.add(row, f"batch {batch:>3}: suffix {row['suffix_ms']} ms, n-gram {row['ngram_ms']} ms a step"
                    + (f", against a plain step of {row['plain_step_ms']} ms" if row["plain_step_ms"]
                       else ""))


# ---- the command ----------------------------------------------------------------------------------

SECTIONS = {"copy_bandwidth": measure_copy_bandwidth, "decode": measure_decode,
            "step_anatomy": measure_step_anatomy, "graphs_vs_eager": measure_graphs_vs_eager,
            "trees": measure_trees,
            "attention_kernel": measure_attention, "draft_vs_assisted": measure_assisted,
            "small_target": measure_small_target, "prefill_attention": measure_prefill,
            "host_drafting": measure_host_drafting, "cuda_tests": run_cuda_tests}
# the model each section uses, kept loaded for the sections after it that use it too
USES = {"decode": "target", "step_anatomy": "target", "graphs_vs_eager": "target", "trees": "target",
        "small_target": "small_target"}


def report_path(out: str | None, device: str, reduced: bool) -> str:
    slug = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") or "device"
    return out or os.path.join("bench_results", f"gpu_check_{slug}{'_reduced' if reduced else ''}.json")


def gpu_check(device: str = "auto", out: str | None = None, log=None, sections: list[str] | None = None,
              seconds: float | None = None) -> dict:
    """Run the check (`sections`: a subset of SECTIONS, in their order; `seconds`: the run's
    deadline instead of the plan's); writes the report to `out` (default:
    bench_results/gpu_check_<device>.json) after every section and returns it."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    reduced = not (device in ("auto", "cuda") and torch.cuda.is_available())
    plan = dict(REDUCED if reduced else FULL, **({"seconds": seconds} if seconds else {}))
    found = preflight()
    line = preflight_line(found, reduced, plan)
    log(line)
    torch_device = torch.device("cpu" if reduced else "cuda")
    command = f"python -m benchmarks.gpu_check --device {device}" + (
        f" --gpu-check-sections {','.join(sections)}" if sections else "") + (
        f" --gpu-check-seconds {seconds:g}" if seconds else "")
    report = {"command": command, "device": device_name(torch_device),
              "mode": "reduced (no CUDA)" if reduced else "full", "target": plan["target"],
              "small_target": plan["small_target"], "dtype": plan["dtype"], "torch": torch.__version__,
              "python": sys.version.split()[0], "preflight": {**found, "line": line},
              "plan": {name: plan[name] for name in ("batches", "ks", "new_tokens", "oracle_tries", "seconds",
                                                     "budgets")},
              "sections": {}, "summary": [], "finished": False}
    check = GpuCheck(plan, reduced, report_path(out, report["device"], reduced), report, log)
    names = [name for name in SECTIONS if sections is None or name in sections]
    for i, name in enumerate(names):
        check.run(name, SECTIONS[name])
        check.drop([key for key in list(check.models) if key not in {USES.get(n) for n in names[i + 1:]}])
    report["finished"] = True
    check.save()
    for line in summary_lines(report["summary"]):
        log(line)
    log(f"{report['elapsed_s']:.0f} s in all; wrote {check.path}")
    return report


# ---- the command line ----------------------------------------------------------------------------

def build_parser():
    ap = parser("python -m benchmarks.gpu_check", __doc__.split("\n\n")[0] + "\n\nexample:\n"
                "  python -m benchmarks.gpu_check --device cuda --gpu-check-sections decode,cuda_tests")
    ap.add_argument("--device", default="auto",
                    help="auto, cpu or cuda (default: auto; without CUDA a reduced run)")
    ap.add_argument("--out", metavar="FILE.json",
                    help="where to write the report (default: bench_results/gpu_check_<device>.json), "
                         "rewritten after every section")
    ap.add_argument("--gpu-check-sections", metavar="NAMES",
                    help="only these sections (comma-separated, of " + ",".join(SECTIONS)
                         + "), e.g. to rerun one that failed")
    ap.add_argument("--gpu-check-seconds", type=float, metavar="S",
                    help="the run's deadline in seconds (default 480 on a GPU): no section starts after it, "
                         "and the CUDA tests get at most what is left")
    return ap


def check_args(args) -> tuple[list[str] | None, float | None]:
    """--gpu-check-sections and --gpu-check-seconds, checked: (the sections or None for all, the deadline)."""
    if args.gpu_check_seconds is not None and args.gpu_check_seconds <= 0:
        raise NanospecError(f"--gpu-check-seconds must be above 0, got {args.gpu_check_seconds:g}")
    if args.gpu_check_sections is None:
        return None, args.gpu_check_seconds
    names = [name.strip() for name in args.gpu_check_sections.split(",") if name.strip()]
    if not names or any(name not in SECTIONS for name in names):
        raise NanospecError(f"--gpu-check-sections takes names among {','.join(SECTIONS)}, "
                            f"got {args.gpu_check_sections!r}")
    return names, args.gpu_check_seconds


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: gpu_check(args.device, args.out, log_line, *check_args(args)))


if __name__ == "__main__":
    sys.exit(main())
