"""Benchmark: decode throughput over the shipped prompt set, and transformers' generate() on the
same model and prompts in the same run, for the ratio.

    python -m nanospec.bench [--target ...] [--batch-sizes 1,8,32] [--max-new-tokens 64]

Every request generates exactly --max-new-tokens tokens (EOS ignored, greedy), so both engines do
the same work. Prints a table and writes JSON with the device, versions and command.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import resources

import torch

from nanospec.errors import NanospecError


def shipped_prompts(categories: list[str] | None = None) -> list[dict]:
    text = resources.files("nanospec").joinpath("data/prompts.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if not categories or r["category"] in categories]


def transformers_model(path: str, dtype: torch.dtype, device: torch.device):
    """The same checkpoint in transformers (a folder, or a .gguf through transformers' own GGUF reader)."""
    import transformers
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


def time_nanospec(llm, prompt_ids: list[list[int]], max_new_tokens: int) -> float:
    from nanospec import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    engine = llm.engine
    reqs = [engine.new_request(i, "", ids, params) for i, ids in enumerate(prompt_ids)]
    engine.scheduler.waiting.extend(reqs)
    sync(llm.device)
    start = time.perf_counter()
    engine.run_to_completion()
    sync(llm.device)
    elapsed = time.perf_counter() - start
    assert all(len(r.output_ids) == max_new_tokens for r in reqs)
    return len(reqs) * max_new_tokens / elapsed


@torch.inference_mode()
def time_transformers(model, prompt_ids: list[list[int]], max_new_tokens: int, pad_id: int) -> float:
    longest = max(len(ids) for ids in prompt_ids)   # left padding, as batched generate() needs
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompt_ids], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids], device=model.device)
    sync(model.device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad_id)
    sync(model.device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + max_new_tokens
    return len(prompt_ids) * max_new_tokens / elapsed


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def environment(llm) -> dict:
    env = {"device": torch.cuda.get_device_name() if llm.device.type == "cuda" else platform.processor() or "cpu",
           "device_type": llm.device.type, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "dtype": str(llm.dtype)}
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nanospec.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="model folder, hub id or .gguf (default: offline SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--categories", default="", help="comma-separated prompt categories (default: all)")
    ap.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of in the chat template")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="bench_results/plain.json")
    return ap.parse_args(argv)


def run(args) -> dict:
    from nanospec import LLM, checkpoint
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.target, device=args.device, dtype=args.dtype, max_num_seqs=max(batch_sizes))
    rows = shipped_prompts([c for c in args.categories.split(",") if c])
    prompts = [llm.encode_prompt(r["prompt"], chat=not args.no_chat) for r in rows]
    time_nanospec(llm, prompts[:2], 4)   # warm-up
    ref = None
    if not args.no_transformers:
        try:
            ref = transformers_model(checkpoint.resolve(args.target), llm.dtype, llm.device)
            time_transformers(ref, prompts[:2], 4, pad_id=llm.tokenizer.eos_ids[0])
        except ImportError:
            print("transformers is not installed: no baseline (pip install transformers)", file=sys.stderr)
    results = []
    for bs in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(bs)]
        row = {"batch_size": bs, "nanospec_tokens_per_s": round(time_nanospec(llm, batch, args.max_new_tokens), 2)}
        if ref is not None:
            row["transformers_tokens_per_s"] = round(time_transformers(ref, batch, args.max_new_tokens,
                                                                       llm.tokenizer.eos_ids[0]), 2)
            row["ratio"] = round(row["nanospec_tokens_per_s"] / row["transformers_tokens_per_s"], 3)
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"benchmark": "plain decoding (K = 0), greedy, every request max_new_tokens long",
            "command": "python -m nanospec.bench " + " ".join(sys.argv[1:]),
            "target": args.target or checkpoint.DEFAULT_MODEL_FILE, "max_new_tokens": args.max_new_tokens,
            "chat_template": not args.no_chat, "environment": environment(llm), "results": results}


def print_table(report: dict) -> None:
    print(f"{report['target']} on {report['environment']['device']} ({report['environment']['dtype']}), "
          f"{report['max_new_tokens']} new tokens per request")
    print(f"{'batch':>6} {'nanospec tok/s':>15} {'transformers tok/s':>19} {'ratio':>7}")
    for r in report["results"]:
        print(f"{r['batch_size']:>6} {r['nanospec_tokens_per_s']:>15.1f} "
              f"{r.get('transformers_tokens_per_s', float('nan')):>19.1f} {r.get('ratio', float('nan')):>7.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except NanospecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(report)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
