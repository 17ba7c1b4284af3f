"""The benchmark: its rows run side by side on engines of their own, groups or continuous batching
as asked, dynamic-K rows next to static ones, and its flags checked before any model loads."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

from benchmarks import proposers
from benchmarks.proposers import main as proposers_main
from nanospec import bench
from nanospec.bench import main as bench_main
from nanospec.dynamic_k import twin
from nanospec.engine import Engine
from nanospec.prompts import shipped_prompts


@pytest.mark.slow
def test_bench_compares_dynamic_k_with_static_rows(checkpoints, tmp_path):
    out = tmp_path / "bench.json"
    assert bench_main(["--target", checkpoints["llama3"], "--ngram", "--ks",
                       "0,2,dynamic,dynamic-per-request", "--batch-sizes", "1,2",
                       "--max-prompts", "3", "--max-new-tokens", "6", "--no-transformers", "--no-chat",
                       "--repeats", "2", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["batch_size"], r["k"]) for r in report["results"]] == [
        (b, k) for b in (1, 2) for k in (0, 2, "dynamic", "dynamic-per-request")]
    for r in report["results"]:   # every repeat is kept; the row is their best, and all of them together
        each = r["tokens_per_s_each_repeat"]
        assert len(each) == 2 and r["nanospec_tokens_per_s"] == max(each)
        assert r["tokens_per_s_all_repeats"] == pytest.approx(2 / (1 / each[0] + 1 / each[1]), abs=0.01)
    dynamic = [r for r in report["results"] if r["k"] in ("dynamic", "dynamic-per-request")]
    assert all(r["chosen_k"] and r["nanospec_tokens_per_s"] > 0 for r in dynamic)
    assert all(len(r["chosen_k_each_repeat"]) == 2 and r["chosen_k"] in r["chosen_k_each_repeat"]
               for r in dynamic)
    profile = report["dynamic_k_profile"]
    assert profile["batch_sizes"] == [1, 2] and profile["ks"] == [0, 1, 2]


@pytest.mark.slow
def test_bench_num_requests_cycles_the_prompts_and_rejects_bad_values(checkpoints, tmp_path, capsys,
                                                                      monkeypatch):
    out = tmp_path / "bench.json"
    common = ["--target", checkpoints["llama3"], "--ks", "0", "--batch-sizes", "4", "--max-new-tokens", "3",
              "--no-transformers", "--no-chat", "--device", "cpu"]
    assert bench_main(common + ["--max-prompts", "3", "--num-requests", "7", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["num_prompts"], report["distinct_prompts"]) == (7, 3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert bench_main(common + ["--max-prompts", "2"]) == 0
    table = capsys.readouterr().out
    assert not any(elsewhere.iterdir())                   # no --out: no file written
    assert " - " in table and not re.search(r"\bnan\b", table)   # transformers not run: "-", not nan
    assert bench_main(common + ["--num-requests", "-1"]) != 0
    assert "--num-requests must be an integer >= 0" in capsys.readouterr().err
    assert bench_main(common + ["--categories", "no_such_category"]) != 0
    assert "no shipped prompt is in --categories" in capsys.readouterr().err
    assert bench_main([a for a in common if a != "--no-transformers"] + ["--continuous"]) != 0
    assert "--continuous has no transformers baseline" in capsys.readouterr().err
    for ks in ("0,2", "0,dynamic"):   # without a proposer these rows would silently decode plainly
        assert bench_main([a if a != "0" else ks for a in common]) != 0
        err = capsys.readouterr().err
        assert "need a proposer: add --draft PATH, --eagle PATH, --ngram, --suffix or --oracle" in err


@pytest.mark.slow
def test_bench_runs_proposers_side_by_side_on_the_multiturn_workload(spec_models, tmp_path, capsys):
    """Two sessions of three turns, each later turn the conversation so far: every row decodes the
    same tokens (the bench checks it), and the hybrid reports how it chose."""
    out = tmp_path / "proposers.json"
    torch.save(list(range(0, 320, 2)), str(tmp_path / "map.pt"))
    args = ["--target", spec_models["target"], "--eagle", spec_models["eagle1"], "--batch-sizes", "1,2",
            "--max-new-tokens", "12", "--max-prompts", "2", "--device", "cpu", "--out", str(out),
            "--speculative-token-map", str(tmp_path / "map.pt")]
    assert proposers_main(args + ["--proposers",
                                  "plain,ngram,ngram@cold,suffix+0:6,eagle,eagle@map,hybrid:6,hybrid:dynamic",
                              "--workload", "multiturn"]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and report["outputs_identical_across_rows"]
    rows = {(r["batch_size"], r["row"]): r for r in report["results"]}
    assert len(rows) == 16 and all(r["generated_tokens"] == rows[(1, "plain")]["generated_tokens"]
                                   for r in rows.values())
    priced = rows[(2, "hybrid:dynamic")]
    assert priced["k"] == "dynamic" and sum(priced["hybrid_plans"].values()) > 0
    assert rows[(1, "plain")]["mean_acceptance_length"] == 1.0
    assert rows[(1, "suffix+0:6")]["global_index_requests"] == 6
    assert 0 <= rows[(2, "hybrid:6")]["hybrid_suffix_share"] <= 1
    assert set(rows[(1, "ngram")]["acceptance_length_per_category"]) == {"chat", "code"}
    # later turns find the earlier ones cached, except where prefix caching is off
    assert rows[(1, "ngram")]["prefix_cache_hits"] > 0 and rows[(1, "ngram")]["prefix_caching"]
    assert rows[(1, "ngram@cold")]["prefix_cache_hits"] == 0 and not rows[(1, "ngram@cold")]["prefix_caching"]
    assert rows[(1, "eagle")]["prefix_cache_hits"] > 0   # a model drafter's cache too
    assert proposers_main(args[:2] + ["--proposers", "ngram@warm"]) != 0
    assert "'ngram@warm': a row option after @ is cold" in capsys.readouterr().err
    # options add up; @records leaves a budget's placing to each request's record
    row = "suffix:dynamic-per-request@tree3@cold@records"
    row_args = proposers.build_parser().parse_args(args[:2] + ["--proposers", row])
    assert proposers.parse_rows(row, row_args) == [(row, "dynamic-per-request")]
    settings = proposers.row_settings(row, row_args)
    assert settings["speculative_topk"] == 3 and settings["enable_prefix_caching"] is False
    # @map: the eagle rows that draft among --speculative-token-map's ids (only they)
    assert proposers.row_settings("eagle@map", row_args)["speculative_token_map"] is None   # (no map given)
    map_args = proposers.build_parser().parse_args(args + ["--proposers", "eagle,eagle@map"])
    assert [proposers.row_settings(r, map_args)["speculative_token_map"] for r in ("eagle", "eagle@map")] == \
        [None, str(tmp_path / "map.pt")]
    assert proposers_main(args[:4] + ["--proposers", "eagle@map"]) != 0
    assert "'eagle@map': @map is for an eagle row, with --speculative-token-map" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "suffix@records"]) != 0
    assert "@records is for a budget's rows" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "hybrid"]) != 0
    assert "--proposers hybrid needs a model drafter: add --eagle HEAD" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "ngram", "--ks", "0,4"]) != 0
    assert "with --proposers give each row its own K (NAME:K)" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "ngram,nope"]) != 0
    assert "unknown proposer 'nope'" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "ngram:fast"]) != 0
    assert "'ngram:fast' is not NAME, NAME:K, NAME:dynamic or NAME:dynamic-per-request" in \
        capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "ngram+3"]) != 0
    assert "'ngram+3': +N is a suffix or hybrid row's max_spec_offset" in capsys.readouterr().err
    assert proposers_main(args[:2] + ["--proposers", "ngram", "--suffix-max-spec-offset", "3"]) != 0
    assert "--suffix-max-spec-offset is for suffix and hybrid rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # the rows of proposers are benchmarks.proposers', no longer bench's
        bench_main(args[:2] + ["--workload", "multiturn"])
    assert "unrecognized arguments: --workload multiturn" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # and there a row is required
        proposers_main(args[:2] + ["--workload", "multiturn"])
    assert "the following arguments are required: --proposers" in capsys.readouterr().err


def test_rows_that_decode_different_tokens_are_counted_by_prompt():
    """What benchmarks.proposers compares: each row's requests (prompt and tokens) against the reference
    row's, as multisets: finished in another order they are the same; one differing answer also
    changes its session's next prompt, which may sort elsewhere, and still counts as what differs."""
    req = lambda prompt, out: (None, SimpleNamespace(prompt_ids=prompt, output_ids=out))
    state = {"ngram": {"done": [req([1], [5, 6]), req([1, 5, 6, 2], [7]), req([3], [8])]},
             "suffix": {"done": [req([3], [8]), req([1, 5, 6, 2], [7]), req([1], [5, 6])]},   # another order
             # a turn and the next
             "eagle": {"done": [req([1], [5, 9]), req([1, 5, 9, 2], [7]), req([3], [8])]}}
    assert proposers.differing_requests(state, "ngram") == {"eagle": 2}
    assert proposers.differing_requests(state, "eagle") == {"ngram": 2, "suffix": 2}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_that_differ_stop_a_float32_run_and_are_reported_in_lower_precision(spec_models, tmp_path,
                                                                                 capsys, monkeypatch, dtype):
    """float32: every row must decode the same tokens (a proposer that did not would not be lossless).
    bfloat16: a verify step's products round otherwise than a one-token step's, so greedy near-ties
    may break otherwise; the run goes on and says so (GPU runs default to bfloat16)."""
    monkeypatch.setattr(proposers, "differing_requests", lambda state, reference: {"suffix": 1})
    out = tmp_path / "proposers.json"
    code = proposers_main(["--target", spec_models["target"], "--batch-sizes", "1", "--max-new-tokens", "4",
                       "--max-prompts", "1", "--device", "cpu", "--dtype", dtype, "--proposers",
                           "ngram,suffix",
                       "--out", str(out)])
    err = capsys.readouterr().err
    if dtype == "float32":
        assert code != 0 and "a proposer is not lossless" in err and not out.exists()
    else:
        assert code == 0 and "in bfloat16 the rows decoded different tokens" in err
        report = json.loads(out.read_text())
        assert not report["outputs_identical_across_rows"]
        assert [(r["reference_row"], r["requests_unlike_reference_row"]) for r in report["results"]] == [
            ("ngram", 0), ("ngram", 1)]


def test_bench_rows_take_turns_step_by_step(tiny_llm, monkeypatch):
    """Drift on a shared machine must hit every row alike: each row is an engine of its own over
    the same model, and the rows take turns a step at a time; each row queues its groups one after
    another (continuous: all at once, at most batch-size running) and keeps its own statistics. The
    LLM's own engine is untouched."""
    prompts = [tiny_llm.encode_prompt(r["prompt"], chat=False) for r in shipped_prompts()[:7]]
    steps_before = tiny_llm.engine.stats.steps   # (the fixture is shared: other tests may have used it)
    steps, step = [], Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: (steps.append(   # (engine, K, queued, running) before it
        (self, self.k_policy.k, len(self.scheduler.waiting) + len(self.scheduler.running),
         len(self.scheduler.running))), step(self))[1])
    measured = bench.time_rows(tiny_llm, prompts, 4, [2, 0],
                               SimpleNamespace(continuous=False, max_new_tokens=3), None, 2)
    engines = {k: e for e, k, *_ in steps}
    assert len(engines) == 2 and tiny_llm.engine not in engines.values()
    assert engines[2].model is tiny_llm.model and engines[2].kv_cache is not tiny_llm.engine.kv_cache
    # a pool for the bench's requests, not another like the LLM's (on a GPU that takes most of the memory)
    assert engines[2].kv_cache.allocator.num_blocks < tiny_llm.engine.kv_cache.allocator.num_blocks
    assert [k for _, k, *_ in steps[:6]] == [2, 0, 2, 0, 2, 0]
    for k in (2, 0):   # a group of 4, then (once it is done) the last 3
        queued = [n for e, _, n, _ in steps if e is engines[k]]
        assert queued[0] == 4 and 3 in queued and queued.index(3) > queued.index(4)
    assert engines[2].stats.steps > 0 and engines[0].stats.drafted_tokens == 0
    assert list(measured) == [2, 0] and all(m["tokens_per_s"] > 0 for m in measured.values())
    steps.clear()
    bench.time_rows(tiny_llm, prompts, 4, [0, 2], SimpleNamespace(continuous=True, max_new_tokens=3), None, 2)
    assert steps[0][2] == 7 and max(running for *_, running in steps) == 4   # all queued, 4 running
    assert tiny_llm.engine.scheduler.max_num_seqs == 64 and tiny_llm.engine.stats.steps == steps_before


@pytest.mark.parametrize("args, match", [
    (["--batch-sizes", "a"], "--batch-sizes takes comma-separated integers"),
    (["--batch-sizes", "0"], "--batch-sizes must be integers >= 1"),
    (["--ks", "99"], "--ks must be K values in 0..16"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--repeats", "0"], "--repeats must be an integer >= 1"),
    (["--num-requests", "-1"], "--num-requests must be an integer >= 0"),
    (["--oracle", "--ks", "0,dynamic", "--profile", "p.json"], "--oracle rows have a fixed K"),
])
def test_bad_bench_flags_are_one_line_before_loading(capsys, args, match):
    assert bench.main(["--no-transformers", "--target", "/never/loaded", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


def test_the_oracle_drafts_are_all_accepted(tiny_llm):
    """The oracle proposer replays the target's own greedy continuation: at K = 4 every draft is
    accepted and each request gains K + 1 tokens a step (fewer only where max_tokens cuts K), and
    the output is plain decoding's. (Not the identity: a proposer drafting the token after the
    right one is accepted nowhere.)"""
    from nanospec.bench import oracle_proposer
    from nanospec.dynamic_k import greedy_requests
    from nanospec.k_policy import StaticK
    prompts = [tiny_llm.encode_prompt(r["prompt"], chat=False) for r in shipped_prompts()[:5]]
    oracle = oracle_proposer(tiny_llm.engine, prompts, 20)
    engine = twin(tiny_llm.engine, 200, max_num_seqs=5, k_policy=StaticK(4), proposer=oracle)
    requests = greedy_requests(engine, prompts, 20)
    engine.run_to_completion()
    stats = engine.stats.as_dict()
    assert stats["acceptance_rate_per_position"] == [1.0] * 4
    assert stats["mean_acceptance_length"] == 5.0   # 20 tokens: 4 steps of K + 1 = 5
    assert [r.output_ids for r in requests] == [oracle.continuations[tuple(p)] for p in prompts]


@pytest.mark.slow
def test_bench_runs_random_models_with_the_oracle(capsys):
    assert bench_main(["--target", "random:tiny", "--device", "cpu", "--oracle", "--ks", "0,4",
                       "--batch-sizes", "2",
                       "--max-new-tokens", "10", "--max-prompts", "2", "--no-transformers", "--no-chat"]) == 0
    out = capsys.readouterr().out
    assert "random:tiny" in out and " 5.00 " in out   # the oracle row's acceptance length: K + 1


def test_transformers_runs_a_random_model_on_our_weights():
    """The transformers baseline of random:NAME is transformers' own model of its config holding
    our random weights (shared, not copied): greedy decoding gives the same tokens."""
    import torch
    from nanospec import LLM, SamplingParams
    from nanospec.bench import transformers_model
    llm = LLM("random:tiny", device="cpu", dtype="float32", kv_cache_gb=0.01)
    hf = transformers_model("random:tiny", torch.float32, torch.device("cpu"), llm.model)
    ids = [5, 9, 100, 33, 7, 200]
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                         pad_token_id=256)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert theirs[0, len(ids):].tolist() == ours
    assert hf.model.embed_tokens.weight.data_ptr() == llm.model.model.embed_tokens.weight.data_ptr()


def test_cpu_dtype_times_every_way_and_puts_the_fast_dtypes_back(checkpoints, tmp_path):
    """benchmarks.cpu_dtype: float32 and bfloat16 (and bfloat16 through F.linear where the CPU has native
    bfloat16) at each batch size, a rate per repeat; cpu_linear's choice is left as it found it."""
    from benchmarks import cpu_dtype
    from nanospec import cpu_linear
    default = cpu_linear.FAST_DTYPES
    cpu_dtype.main(["--target", checkpoints["llama3"], "--batch-sizes", "1,2", "--max-new-tokens", "4",
                    "--repeats", "2", "--no-train", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    ways = ["float32", "bfloat16"] + (["bfloat16, F.linear"] if cpu_linear.NATIVE_BF16 else [])
    rows = sorted(f"{way}, batch {b}" for way in ways for b in (1, 2))
    assert sorted(report["plain_tokens_per_second"]) == rows
    assert all(len(r) == 2 and min(r) > 0 for r in report["plain_tokens_per_second"].values())
    assert cpu_linear.FAST_DTYPES == default and report["train_step_seconds"] == {} and "cpu_flags" in report


def test_few_row_linear_compares_both_ways_and_puts_the_default_back(checkpoints, tmp_path):
    """benchmarks.few_row_linear: both 1-2 row products decode the same tokens; the module's choice is
    left as it found it."""
    from benchmarks import few_row_linear
    from nanospec import cpu_linear
    default = cpu_linear.FEW_ROWS_BY_MKL
    few_row_linear.main(["--target", checkpoints["llama3"], "--batch-sizes", "1,2", "--max-new-tokens", "4",
                         "--repeats", "2", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 2] and cpu_linear.FEW_ROWS_BY_MKL == default
    assert all(r["same_tokens"] and len(r["tokens_per_s"]["packed"]) == 2 for r in report["results"])
    assert report["default_few_rows_by_mkl"] == default and "cpu_flags" in report
