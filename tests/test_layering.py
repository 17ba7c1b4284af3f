"""Dependencies point one way: each module of the package imports only modules of lower layers, at
the top or inside a function, so that no cycle can come back unnoticed; and every module imports.
The harnesses (benchmarks/) and utilities (tools/) sit above the package: they import it, it never
imports them."""
import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanospec"
ABOVE = ("benchmarks", "tools")   # the folders of harnesses and utilities beside the package

# Layer by layer, lowest first: a module may import the modules of the layers before its own.
LAYERS = [
    {"errors", "stats"},
    {"kv_cache", "cpu_linear", "triton_attention", "sampler", "gguf_file", "prompts", "estimators",
     "k_policy", "chat_template", "sampling_params"},
    {"kv_mirror", "request", "logits_processors", "tree"},
    {"model", "proposer"},
    {"checkpoint", "suffix"},
    {"tokenizer", "eagle", "cuda_graph", "hybrid"},
    {"engine"},
    {"dynamic_k"},   # the K policy by goodput, and the profiler that measures ITL with real engines
    {"llm", "engine_loop", "metrics"},
    {"__init__", "cli"},   # the package's names (LLM, SamplingParams, ...); the command lines' shared flags
    {"generate", "bench_serve", "profiler", "serve"},
    {"bench"},   # `bench serve` is bench_serve's
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py"))


def nanospec_imports(path: pathlib.Path) -> set[str]:
    """The package modules a file imports, anywhere in it (`from nanospec import X` names module X
    where X is one, else the package's __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("nanospec.")}
            found |= {"__init__" for a in node.names if a.name == "nanospec"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nanospec":
            if node.module == "nanospec":
                found |= {a.name if a.name in MODULES else "__init__" for a in node.names}
            else:
                found.add(node.module.split(".")[1])
    return found


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), "place new modules in LAYERS"


@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_lower_layers(module):
    upward = {m for m in nanospec_imports(PACKAGE / f"{module}.py") if LAYER[m] >= LAYER[module]}
    assert not upward, f"nanospec/{module}.py imports {sorted(upward)}, which are not below it"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module):
    importlib.import_module("nanospec" if module == "__init__" else f"nanospec.{module}")


def top_level_imports(path: pathlib.Path) -> set[str]:
    """The top-level packages a file imports, anywhere in it (relative imports aside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", MODULES)
def test_the_package_never_imports_the_harnesses(module):
    above = top_level_imports(PACKAGE / f"{module}.py") & set(ABOVE)
    assert not above, f"nanospec/{module}.py imports {sorted(above)}: the package must not depend on them"


@pytest.mark.parametrize("module", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_harness_imports(module):
    importlib.import_module(f"benchmarks.{module}")


def test_the_check_finds_an_upward_import_inside_a_function(tmp_path):
    """The test has the power to fail: an import hidden in a function body is found."""
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    from nanospec.llm import LLM\n    import nanospec.bench\n"
                      "    from nanospec import dynamic_k\n    from benchmarks.measure import decoding\n")
    assert nanospec_imports(sneaky) == {"llm", "bench", "dynamic_k"}
    assert top_level_imports(sneaky) == {"nanospec", "benchmarks"}
