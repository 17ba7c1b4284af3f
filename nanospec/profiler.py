"""Measure a dynamic-K profile (step time over batch size x K, acceptance per draft position) on
this machine with the real engine and proposer, and write it as JSON for --profile.

example:
  python -m nanospec.profiler --ngram --out profile.json
  python -m nanospec.generate --ngram --dynamic-k --profile profile.json --chat \\
      --prompt "Fix the typo: def ad(a, b): return a + b"
"""
from __future__ import annotations

import os
import sys

from nanospec.cli import add_model_args, add_proposer_args, int_list, load_llm, log, parser, proposer_given
from nanospec.dynamic_k import Profile, measure_profile
from nanospec.errors import NanospecError, check_int, run_command
from nanospec.llm import MAX_SPECULATIVE_TOKENS
from nanospec.prompts import read_prompts_file, shipped_prompts


def build_parser():
    ap = parser("python -m nanospec.profiler", __doc__)
    add_model_args(ap)
    add_proposer_args(ap)
    ap.add_argument("--out", default="profile.json", help="where to write the profile")
    ap.add_argument("--prompts",
                    help="JSON lines with a 'prompt' field (default: the shipped benchmark prompts)")
    ap.add_argument("--no-chat", action="store_true", help="feed prompts raw instead of in the chat template")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated; must start at 1")
    ap.add_argument("--max-k", type=int, default=8, help="time every K in 0..max-k")
    ap.add_argument("--ks", default="", help="K values to time instead (must include 0)")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per point; the median counts")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="tokens per prompt for the acceptance rates")
    return ap


def profile_command(args, command_line: str) -> Profile:
    batch_sizes = sorted(set(int_list(args.batch_sizes, "--batch-sizes")))
    if not args.ks:
        check_int(args.max_k, "--max-k", low=1, high=MAX_SPECULATIVE_TOKENS)
    ks = sorted(set(int_list(args.ks, "--ks"))) if args.ks else list(range(args.max_k + 1))
    if not batch_sizes or batch_sizes[0] != 1:
        raise NanospecError(f"--batch-sizes must include 1 and be >= 1, got {args.batch_sizes}")
    if len(ks) < 2 or ks[0] != 0 or ks[-1] > MAX_SPECULATIVE_TOKENS:
        raise NanospecError(f"--ks must include 0 and at least one K in 1..{MAX_SPECULATIVE_TOKENS}, "
                            f"got {ks}")
    check_int(args.steps, "--steps", low=1)
    if os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise NanospecError(f"--out {args.out} is not a file in an existing folder: give one")
    check_int(args.max_new_tokens, "--max-new-tokens", low=1)
    if not proposer_given(args):
        raise NanospecError("a dynamic-K profile needs a proposer: add --draft PATH, --eagle PATH, --ngram "
                            "or --suffix")
    texts = read_prompts_file(args.prompts) if args.prompts else [r["prompt"] for r in shipped_prompts()]
    llm = load_llm(args, max_num_seqs=batch_sizes[-1], num_speculative_tokens=ks[-1])
    prompts = [llm.encode_prompt(t, chat=not args.no_chat) for t in texts]
    profile = measure_profile(llm.engine, prompts, batch_sizes, ks, args.steps, args.max_new_tokens,
                              llm.profile_meta(), log)
    profile.meta["command"] = command_line
    profile.save(args.out)
    print(f"wrote {args.out} ({profile.meta['seconds']:.0f} s)")
    return profile


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command_line = "python -m nanospec.profiler " + " ".join(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: profile_command(args, command_line))


if __name__ == "__main__":
    sys.exit(main())
