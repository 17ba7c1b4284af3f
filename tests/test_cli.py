"""The command line as a person uses it: JSON output of the documented shape, and bad input answered
by one line that names the fix, exit status 2, no traceback."""
import json
import os
import shutil
import subprocess
import sys

import pytest


def one_error_line(err: str) -> bool:
    """stderr ends in exactly one error line; before it, at most the progress lines of loading."""
    lines = err.strip().splitlines()
    return (lines[-1].startswith("error: ")
            and all(line.startswith(("loading ", "loaded in ")) for line in lines[:-1]))


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "nanospec.generate", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_json_output(checkpoints, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The quick brown", "id": 7}) + "\n"
                       + json.dumps({"prompt": "def add"}) + "\n")
    code, out, err = run_cli("--target", checkpoints["llama3"], "--prompts-file", str(prompts),
                             "--prompt", "12345", "--max-new-tokens", "5", "--json", "--temperature", "0.5",
                             "--top-k", "20")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows[:3]] == ["12345", "The quick brown", "def add"]
    for i, r in enumerate(rows[:3]):
        assert r["index"] == i and r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)
        assert 1 <= len(r["token_ids"]) <= 5
    stats = rows[3]["stats"]
    for key in ("generated_tokens", "steps", "mean_acceptance_length", "acceptance_rate_per_position",
                "tokens_per_second"):
        assert key in stats


@pytest.mark.slow
def test_streaming_text_and_stats_line(checkpoints):
    code, out, err = run_cli("--target", checkpoints["qwen2"], "--prompt", "Hello", "--max-new-tokens", "6",
                             "--chat")
    assert code == 0, err
    assert "tokens/s" in out.splitlines()[-1]


def test_streamed_text_never_shows_part_of_a_stop_string(capsys):
    """The CLI streams as the server does: "st" may start the stop "stop", so it waits; the output
    ends before the stop, so "st" is never printed (printing what came, it was)."""
    from types import SimpleNamespace
    from nanospec import SamplingParams
    from nanospec.generate import Streamer
    from nanospec.tokenizer import byte_tokenizer
    streamer = Streamer(byte_tokenizer(), SamplingParams(stop=["stop"]))
    req = SimpleNamespace(index=0, output_ids=[], finish_reason=None, text=None)
    printed = ""
    for piece in (b"caf\xc3", b"\xa9 st", b"op"):
        req.output_ids = req.output_ids + list(piece)
        if piece == b"op":   # the engine ends the output before the stop
            req.finish_reason, req.text = "stop", "café "
        streamer([req])
        printed += capsys.readouterr().out
        assert "café ".startswith(printed)
    assert printed == "café "


def corrupt(folder, tmp_path, name, content):
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    if content is None:
        os.remove(bad / name)
    else:
        (bad / name).write_bytes(content)
    return str(bad)


@pytest.mark.slow
@pytest.mark.parametrize("case, match", [
    ("missing_config", "missing config.json"),
    ("missing_weights", "no \\*.safetensors weights"),
    ("corrupt_weights", "not a readable safetensors file"),
    ("missing_tokenizer", "no tokenizer.json or tokenizer.model"),
    ("unsupported_arch", "unsupported architecture 'GPT2LMHeadModel'"),
    ("no_such_path", "not found"),
    ("bad_gguf", "not a readable GGUF file"),
])
def test_bad_checkpoint_is_one_clear_line(checkpoints, tmp_path, case, match):
    folder = checkpoints["qwen2"]
    target = {
        "missing_config": lambda: corrupt(folder, tmp_path, "config.json", None),
        "missing_weights": lambda: corrupt(folder, tmp_path, "model.safetensors", None),
        "corrupt_weights": lambda: corrupt(folder, tmp_path, "model.safetensors", b"\x00garbage" * 10),
        "missing_tokenizer": lambda: corrupt(folder, tmp_path, "tokenizer.json", None),
        "unsupported_arch": lambda: corrupt(folder, tmp_path, "config.json",
                                            json.dumps({"architectures": ["GPT2LMHeadModel"]}).encode()),
        "no_such_path": lambda: str(tmp_path / "nope"),
        "bad_gguf": lambda: (tmp_path / "x.gguf").write_bytes(b"not gguf") and str(tmp_path / "x.gguf"),
    }[case]()
    code, out, err = run_cli("--target", target, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == 2
    assert "Traceback" not in err and one_error_line(err)
    assert __import__("re").search(match, err), err


@pytest.mark.slow
@pytest.mark.parametrize("args, match", [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-p", "1.5"], "--top-p must be in"),
    (["--top-k", "-3"], "--top-k must be an integer in 0.."),
    (["--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["--device", "cuda"], "no CUDA GPU is visible"),
    (["--prompt", "word " * 700], "context holds"),
    (["--prompts-file", "/no/such.jsonl"], "not found"),
    (["--ngram", "--num-speculative-tokens", "17"], "must be an integer in 1..16"),
    (["--ngram", "--num-speculative-tokens", "0"], "must be an integer in 1..16"),
    (["--num-speculative-tokens", "4"], "needs a proposer"),
    (["--ngram", "--draft", "x"], "choose one proposer"),
    (["--ngram", "--per-request-k"], "--per-request-k is a setting of dynamic K: add --dynamic-k"),
    (["--suffix", "--draft", "x", "--dynamic-k", "--profile", "p.json"], "--profile is not for the hybrid"),
    (["--ngram", "--suffix-max-spec-offset", "3"],
     "--suffix-max-spec-offset is a setting of suffix decoding: add --suffix"),
    (["--suffix-max-cached-requests", "5"],
     "--suffix-max-cached-requests is a setting of suffix decoding: add --suffix"),
    (["--suffix", "--suffix-min-token-prob", "2"],
     "--suffix-min-token-prob must be a finite number in [0, 1], got 2.0"),
    (["--suffix", "--suffix-max-spec-factor", "-1"],
     "--suffix-max-spec-factor must be a finite number in [0, 16]"),
    (["--ngram", "--suffix-max-spec-factor", "-1"],
     "--suffix-max-spec-factor is a setting of suffix decoding: add --suffix"),
    (["--eagle", "/no/such/head"], "EAGLE head '/no/such/head' not found"),
    (["--max-model-len", "0"], "--max-model-len must be an integer >= 2"),
    (["--stop", ""], "--stop holds an empty string"),
    (["--seed", str(2**63)], "--seed must be an integer in 0.."),
    (["--temperature", "1e-39"], "too small to sample with"),
])
def test_bad_arguments_are_one_clear_line(checkpoints, args, match):
    base = ["--target", checkpoints["qwen2"]] + ([] if "--prompt" in args else ["--prompt", "hi"])
    code, out, err = run_cli(*base, *args)
    assert code == 2 and "Traceback" not in err and match in err and one_error_line(err), err


@pytest.mark.slow
def test_speculative_flags(checkpoints):
    """--ngram and --draft run, print the same greedy text as plain decoding, and report acceptance."""
    base = ["--target", checkpoints["llama3"], "--prompt", "The quick brown fox. The quick brown",
            "--max-new-tokens", "12", "--json"]
    extras = ([], ["--ngram", "--num-speculative-tokens", "3"],
              ["--draft", checkpoints["llama3"], "--num-speculative-tokens", "2"])
    runs = [run_cli(*base, *extra) for extra in extras]
    assert all(code == 0 for code, _, _ in runs), [err for _, _, err in runs]
    rows = [[json.loads(line) for line in out.splitlines()] for _, out, _ in runs]
    assert rows[1][0]["token_ids"] == rows[0][0]["token_ids"] == rows[2][0]["token_ids"]
    assert len(rows[1][1]["stats"]["acceptance_rate_per_position"]) <= 3
    assert rows[2][1]["stats"]["acceptance_rate_per_position"][0] == 1.0   # the target as its own draft
    assert rows[2][1]["stats"]["mean_acceptance_length"] > 2


@pytest.mark.slow
def test_draft_with_another_vocabulary_is_refused(checkpoints, tmp_path):
    other = corrupt(checkpoints["llama3"], tmp_path, "tokenizer.json", None)
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(os.path.join(checkpoints["llama3"], "tokenizer.json"))
    vocab = tok.get_vocab()
    swapped = {t: (i + 1) % len(vocab) if i > 10 else i for t, i in vocab.items()}   # same size, other ids
    data = json.loads(tok.to_str())
    data["model"]["vocab"] = swapped
    (tmp_path / "bad" / "tokenizer.json").write_text(json.dumps(data))
    code, out, err = run_cli("--target", checkpoints["llama3"], "--draft", other, "--prompt", "hi")
    assert code == 2 and "different vocabulary" in err and "Traceback" not in err, err


def bad_prompts_file(tmp_path, kind):
    path = tmp_path / "prompts.jsonl"
    if kind == "folder":
        return str(tmp_path)
    path.write_bytes({"binary": b"\xff\xfe\x00\x01binary", "empty": b"\n\n",
                      "line 3": b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n'}[kind])
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("args, match", [
    (["--prompts-file", "FOLDER"], "is a folder; give a .jsonl file"),
    (["--prompts-file", "BINARY"], "is not UTF-8 text"),
    (["--prompts-file", "EMPTY"], "holds no prompt"),
    (["--prompts-file", "LINE 3"], "prompts.jsonl:3 is not a JSON object"),
    (["--prompt", ""], "--prompt 1 is empty"),
    (["--prompt", "hi", "--max-model-len", "0"], "--max-model-len must be an integer >= 2"),
    (["--prompt", "hi", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
    (["--prompt", "hi", "--threads", "0"], r"--threads must be an integer in 1\.\.\d+"),
    (["--prompt", "hi", "--threads", "100000"], r"--threads must be an integer in 1\.\.\d+, got 100000; this "
                                                r"machine has \d+ CPUs"),   # (it was a segfault)
])
def test_bad_input_is_one_line_before_the_model_loads(tmp_path, args, match):
    """The target does not exist: each of these is found before anything loads, as one line."""
    args = [bad_prompts_file(tmp_path, a.lower()) if a in ("FOLDER", "BINARY", "EMPTY", "LINE 3") else a
            for a in args]
    code, out, err = run_cli("--target", str(tmp_path / "never_loaded"), *args)
    assert code == 2 and "Traceback" not in err and err.startswith("error: "), err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(match, err), err


@pytest.mark.slow
def test_output_speaks_of_speculation_only_where_there_was_some(checkpoints):
    code, out, err = run_cli("--target", checkpoints["llama3"], "--prompt", "The quick brown",
                             "--max-new-tokens", "4")
    assert code == 0 and out.rstrip().endswith("tokens/s]"), out           # plain: no acceptance figures
    assert "(stopped at max tokens)" in out                                # cut at 4 tokens, and says so
    assert err.startswith("loading ") and "loaded in" in err              # progress on stderr, not stdout
    code, out, err = run_cli("--target", checkpoints["llama3"], "--prompt",
                             "The quick brown. The quick brown", "--max-new-tokens", "6", "--ngram")
    assert code == 0 and "drafts accepted by position" in out.splitlines()[-1], out


def all_parsers():
    import train_eagle
    from nanospec import bench, generate, profiler
    from benchmarks import replay
    return {"generate": generate.build_parser(), "bench": bench.build_parser(),
            "profiler": profiler.build_parser(), "train_eagle": train_eagle.build_parser(),
            "replay": replay.build_parser()}


@pytest.mark.parametrize("name", ["generate", "bench", "profiler", "train_eagle", "replay"])
def test_help_explains_every_flag_and_shows_every_default(name):
    from nanospec.cli import HelpFormatter
    ap = all_parsers()[name]
    assert ap.description and ap.epilog and "example" in ap.epilog, name   # what it does, and one example
    for action in ap._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{name}: {action.option_strings} has no help"
        default = action.default
        if not (default is None or default is False or default == []):
            assert "default" in HelpFormatter(name)._get_help_string(action), \
                f"{name}: {action.option_strings}"
    ap.format_help()   # and it formats


@pytest.mark.parametrize("args, match", [(["--steps", "0"], "--steps must be an integer >= 1"),
                                         (["--max-new-tokens", "0"],
                                          "--max-new-tokens must be an integer >= 1"),
                                         (["--batch-sizes", "2,4"], "--batch-sizes must include 1"),
                                         (["--max-k", "100"], "--max-k must be an integer in 1..16"),
                                         (["--out", "/no/such/folder/p.json"], "not a file in an existing"),
                                         (["--out", "/"], "not a file in an existing folder"),
                                         ([], "needs a proposer")])
def test_bad_profiler_flags_are_one_line_before_loading(capsys, args, match):
    from nanospec import profiler
    proposer = [] if not args else ["--ngram"]
    assert profiler.main(["--target", "/never/loaded", *proposer, *args]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
