"""Held-out acceptance of an EAGLE head at an intermediate training step: a copy of train_eagle.py's
OUT/checkpoint.pt (written every --save-every steps) becomes a head folder in the public layout,
evaluated as train_eagle.py evaluates its final head (the held-out shipped prompts, K = 4, T = 0, in
the dtype it trained in, and the gap diagnostic). Points of a learning curve from one run.

Usage: python -m benchmarks.eagle_checkpoint_eval CHECKPOINT.pt OUT_FOLDER [--target T] [--device D]
"""
import argparse
import json
import os


import train_eagle
from nanospec import LLM
from nanospec.eagle import default_aux_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    cli = ap.parse_args()
    state = train_eagle.load_training_checkpoint(cli.checkpoint)
    run_args = state["args"]
    args = train_eagle.parse_args(["--out", cli.out, "--device", cli.device, "--dtype", run_args["dtype"],
                                   "--arch", run_args["arch"]]
                                  + (["--target", run_args["target"]] if run_args["target"] else []))
    llm = LLM(args.target, device=args.device, dtype=args.dtype)
    dtype = train_eagle.dtype_name(llm.dtype)
    aux = default_aux_layers(llm.config.num_layers) if args.arch == "eagle3" else ()
    draft_vocab = (state["head"]["lm_head.weight"].shape[0] if args.arch == "eagle3"
                   else run_args["draft_vocab"])
    cfg = train_eagle.head_config(llm.config, args.arch, draft_vocab, aux, dtype)
    head = train_eagle.new_head(llm.config, cfg, draft_vocab)
    head.load_state_dict(state["head"])
    os.makedirs(cli.out, exist_ok=True)
    train_eagle.save_head(args, head, cfg)
    result = {"checkpoint": cli.checkpoint, "step": state["step"],
              "sequences_seen": state["step"] * run_args["batch_size"],
              "eval": train_eagle.evaluate(args, dtype)}
    result["eval"]["gap"] = train_eagle.held_out_gap(llm, head, args, aux, result["eval"], state["history"])
    train_eagle.print_evaluation(result["eval"])
    with open(os.path.join(cli.out, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
