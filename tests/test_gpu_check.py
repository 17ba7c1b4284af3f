"""python -m benchmarks.gpu_check: a preflight line, then sections that each keep their own time
budget and their own failure, the report on disk rewritten after every section (and row), and a
summary of each headline figure against its goal. On a CPU the dry run goes through every section's
code; the CUDA tests it would run are exactly those marked @pytest.mark.cuda."""
import ast
import json
import pathlib

import pytest

from benchmarks import gpu_check

TESTS = pathlib.Path(__file__).resolve().parent


@pytest.mark.slow
def test_the_dry_run_goes_through_every_section_and_a_failure_loses_nothing_around_it(tmp_path, monkeypatch,
                                                                                      capsys):
    out = tmp_path / "check.json"
    on_disk = []   # the file's sections after each save
    save = gpu_check.GpuCheck.save
    monkeypatch.setattr(gpu_check.GpuCheck, "save",
                        lambda self: (save(self),
                                      on_disk.append(list(json.loads(out.read_text())["sections"]))))

    def broken(check, section):
        raise RuntimeError("the kernel exploded\nwith a second line")
    monkeypatch.setitem(gpu_check.SECTIONS, "attention_kernel", broken)
    monkeypatch.setitem(gpu_check.REDUCED["budgets"], "small_target", 0)   # one row, then the budget stops it
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("preflight: missing a CUDA GPU") and "Runs reduced" in err.splitlines()[0]

    report = json.loads(out.read_text())
    sections = report["sections"]
    assert report["finished"] and report["mode"] == "reduced (no CUDA)"
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, entry in sections.items():   # rows, or a reason
        assert entry["rows"] or entry.get("skipped") or entry.get("error"), name
    assert sections["attention_kernel"]["error"] == "RuntimeError: the kernel exploded"
    assert "[attention_kernel] error: RuntimeError: the kernel exploded\n" in err
    assert sections["copy_bandwidth"]["rows"][0]["gb_s"] > 0                 # before the failure
    assert sections["prefill_attention"]["rows"] and sections["graphs_vs_eager"]["rows"]   # and after it
    assert "no CUDA GPU" in sections["cuda_tests"]["skipped"]
    small = sections["small_target"]
    assert len(small["rows"]) == 1 and "budget of 0 s" in small["stopped"]
    for row in sections["decode"]["rows"]:   # the oracle's acceptance as measured, on its own row's engine
        assert row["mean_acceptance_length"] == row["k"] + 1 and row["oracle_tries"] == 1
        assert (row["k"] == 0) == ("fraction_of_copy_bandwidth" in row)

    names = list(gpu_check.SECTIONS)   # saved after every section, failed or not, and after every row
    for i in range(len(names)):
        assert names[:i + 1] in on_disk
    assert sum(s[-1] == "decode" for s in on_disk) > len(sections["decode"]["rows"])

    summary = {f["figure"]: f for f in report["summary"]}
    trees = sections["trees"]["rows"][0]   # the tree of 2K nodes accepts its chain of K whole, as the chain
    assert trees["tree"]["k"] == 2 * trees["chain"]["k"] == 8
    assert trees["tree"]["mean_acceptance_length"] == trees["chain"]["mean_acceptance_length"] == 5
    assert len(summary) == 12 and all(f["status"] in ("not judged (reduced run)",
                                                     "unmeasured") for f in summary.values())
    kernel = next(f for name, f in summary.items() if name.startswith("attention kernel"))
    assert kernel["status"] == "unmeasured" and kernel["detail"] == "RuntimeError: the kernel exploded"
    assert "\nsummary " in err and all(name in err for name in summary)


def test_an_oracle_row_records_its_own_continuation_until_every_draft_is_accepted():
    """A continuation recorded elsewhere may differ from this row's (bf16 near-ties on a GPU): the row
    takes its own outputs as the oracle and runs again; the tries and acceptances are reported."""
    from nanospec import LLM
    from nanospec.proposer import OracleProposer
    llm = LLM("random:tiny", device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=2)
    prompts = [[5, 9, 100, 33], [7, 200, 31, 8, 9]]
    right = gpu_check.oracle_proposer(llm.engine, prompts, 15).continuations
    wrong = {p: c[:7] + [(c[7] + 1) % 256] + c[8:] for p, c in right.items()}   # one token off
    loaded = gpu_check.Loaded(llm, prompts, OracleProposer(wrong))
    row = gpu_check.decode_row(loaded, 2, 4, False, dict(new_tokens=15, oracle_tries=3))
    assert row["oracle_tries"] == 2 and row["acceptance_each_try"][0] < 5
    assert row["mean_acceptance_length"] == 5
    assert loaded.oracle.continuations == wrong   # the shared oracle is left as it was


def test_every_test_that_needs_cuda_carries_the_cuda_marker():
    """The GPU check's test step runs `pytest -m cuda tests/`: exactly the tests that skip without CUDA."""
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                needs_cuda = any("skipif" in d and "cuda.is_available" in d for d in decorators)
                assert needs_cuda == ("pytest.mark.cuda" in decorators), f"{path.name}::{node.name}"
                found += [node.name] * needs_cuda
    assert len(found) >= 3
    assert '"cuda: ' in (TESTS.parent / "pyproject.toml").read_text()   # registered: -m cuda is no typo


def test_pytest_output_is_read_even_when_the_run_was_cut_off():
    done = ("tests/test_a.py::test_x PASSED  [ 50%]\ntests/test_a.py::test_y FAILED  [100%]\n"
            "FAILED tests/test_a.py::test_y - AssertionError: 1 != 2\n"
            "========== 1 failed, 1 passed, 300 deselected in 12.30s ==========\n")
    failure = "FAILED tests/test_a.py::test_y - AssertionError: 1 != 2"
    assert gpu_check.read_pytest(done) == {"summary": "1 failed, 1 passed, 300 deselected in 12.30s",
                                           "failed": 1, "passed": 1, "deselected": 300, "failures": [failure]}
    cut = ("tests/test_a.py::test_x[1] PASSED  [ 10%]\ntests/test_a.py::test_x[2] PASSED  [ 20%]\n"
           "tests/test_a.py::t")
    assert gpu_check.read_pytest(cut) == {"summary": None, "passed": 2, "failures": []}
    cut = ("[gw1] [ 50%] PASSED tests/test_a.py::test_x[1] \n[gw0] [100%] FAILED tests/test_a.py::test_y \n"
           "[gw1] [ 60%] PASSED tests/test_a.py::t")   # pytest-xdist's lines
    assert gpu_check.read_pytest(cut) == {"summary": None, "passed": 2, "failed": 1, "failures": []}


@pytest.mark.slow
def test_the_cuda_tests_run_alone_and_a_timeout_is_recorded_not_fatal(tmp_path, monkeypatch):
    """The test step runs only the marked tests, in a subprocess; one killed at its timeout leaves a
    row saying so (here, on a CPU, the marked test of one file is collected and skips)."""
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", ["-m", "cuda", "tests/test_triton_attention.py"])
    rows = []
    for timeout in (120, 0.01):
        report = {"sections": {}}
        check = gpu_check.GpuCheck(dict(gpu_check.REDUCED, cuda_tests_timeout=timeout), True,
                                   str(tmp_path / "check.json"), report, lambda line: None)
        check.cuda = True   # as if on a GPU
        gpu_check.run_cuda_tests(check, gpu_check.Section(check, "cuda_tests", 300))
        rows += report["sections"]["cuda_tests"]["rows"]
    finished, killed = rows
    assert finished["returncode"] == 0 and not finished["timed_out"]
    marked = (TESTS / "test_triton_attention.py").read_text().count("@pytest.mark.cuda")
    # the CPU tests left out: none ran (pytest-xdist's summary, where it runs them, counts no deselected)
    assert finished["skipped"] == marked >= 2, finished
    assert not finished.get("passed") and not finished.get("failed"), finished
    assert killed["timed_out"] and killed["summary"] == "timed out after 1 s" and "tail" in killed


def test_a_kernel_is_timed_over_many_launches():
    calls = []
    seconds, timer = gpu_check.kernel_seconds(gpu_check.torch.device("cpu"), lambda: calls.append(1),
                                              launches=30)
    assert len(calls) == 31 and seconds >= 0 and timer == "perf_counter over 30 calls"   # 1 warm-up


@pytest.mark.parametrize("args, match", [
    (["--gpu-check-sections", "decode,nothing"],
     "--gpu-check-sections takes names among copy_bandwidth,decode"),
    (["--gpu-check-seconds", "0"], "--gpu-check-seconds must be above 0"),
])
def test_bad_gpu_check_flags_are_one_line(capsys, args, match):
    assert gpu_check.main(["--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err


def test_a_figure_with_a_ceiling_passes_at_or_under_it():
    """Kernels a layer have a ceiling (at most 15), the other figures a floor."""
    status = lambda value, **kw: gpu_check.figure("f", value, 15, "<= 15", False, "", **kw)["status"]
    assert [status(11, at_most=True), status(15, at_most=True),
            status(16, at_most=True)] == ["pass", "pass", "fail"]
    assert [status(16), status(11)] == ["pass", "fail"]
