"""Generate text with a target model, plainly or with speculative decoding (a draft model, an EAGLE
head or n-gram prompt lookup). One prompt streams its answer as it is generated; several are
batched and printed when done; --json prints one JSON object per request and a last {"stats": ...}.
Bad input is one line that says what to fix, with exit status 2; progress goes to stderr.

example:
  python -m nanospec.generate --chat --prompt "Write a haiku about the sea."
  python -m nanospec.generate --ngram --num-speculative-tokens 4 --chat \\
      --prompt "Fix the typo: def ad(a, b): return a + b"
"""
from __future__ import annotations

import json
import sys

from nanospec.cli import add_llm_args, load_llm, parser
from nanospec.sampling_params import SamplingParams
from nanospec.engine_loop import TextStream, Update
from nanospec.errors import NanospecError, run_command
from nanospec.prompts import read_prompts_file


def build_parser():
    ap = parser("python -m nanospec.generate", __doc__)
    add_llm_args(ap)
    ap.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    ap.add_argument("--prompts-file", metavar="FILE.jsonl", help="JSON lines with a 'prompt' field")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                    help="tokens to generate at most per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy")
    ap.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling; 1 is off")
    ap.add_argument("--top-k", type=int, default=0, metavar="K",
                    help="sample among the K most likely; 0 is off")
    ap.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="stop the answer before this text; repeatable")
    ap.add_argument("--json", action="store_true", help="one JSON object per request, then the stats")
    return ap


def read_prompts(args) -> list[str]:
    """The prompts, checked before any model loads."""
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise NanospecError("no prompt given: use --prompt TEXT or --prompts-file FILE.jsonl")
    for i, prompt in enumerate(prompts):
        if not prompt:
            where = (f"--prompt {i + 1}" if i < len(args.prompt)
                     else f"prompt {i - len(args.prompt) + 1} of {args.prompts_file}")
            raise NanospecError(f"{where} is empty; give at least one word of text")
    return prompts


def format_stats(stats: dict) -> str:
    """The run in one line: speculation's figures only where there was speculation."""
    line = (f"{stats['generated_tokens']} tokens in {stats['elapsed_s']:.2f} s: "
            f"{stats['tokens_per_second']:.1f} tokens/s")
    if stats["drafted_tokens"]:
        rates = ", ".join(f"{r:.2f}" for r in stats["acceptance_rate_per_position"])
        chosen = "; ".join(f"batch {b}: " + " ".join(f"K={k} x{n}" for k, n in ks.items())
                           for b, ks in stats["chosen_k"].items())
        line += (f"; {stats['mean_acceptance_length']:.2f} tokens per step per request, drafts accepted by "
                 f"position: {rates}; steps per K: {chosen}")
    return f"[{line}]"


class Streamer:
    """Prints the newly decoded text of request 0 after each step, as the server streams it: whole
    UTF-8 characters, nothing that may yet turn out to start a stop string."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.stream, self.seen = TextStream(tokenizer, params.stop, params.skip_special_tokens), 0

    def __call__(self, requests) -> None:
        for req in requests:
            if req.index != 0:
                continue
            new, self.seen = req.output_ids[self.seen:], len(req.output_ids)
            sys.stdout.write(self.stream.push(Update(new, req.finish_reason, req.text))
                             + (CUT if req.finish_reason == "length" else ""))
            sys.stdout.flush()


CUT = " (stopped at max tokens)"


def run(args) -> None:
    prompts = read_prompts(args)
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=args.max_new_tokens, seed=args.seed + i, stop=args.stop)
              for i in range(len(prompts))]
    for p in params:
        p.validate()
    llm = load_llm(args)
    stream = len(prompts) == 1 and not args.json
    on_step = Streamer(llm.tokenizer, params[0]) if stream else None
    outputs = llm.generate(prompts, params, chat=args.chat, on_step=on_step)
    if args.json:
        for o in outputs:
            print(json.dumps({"index": o.index, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}, ensure_ascii=False))
        print(json.dumps({"stats": llm.stats}))
        return
    if not stream:
        for o in outputs:
            print(f"--- [{o.index}] {o.prompt!r}\n{o.text}{CUT if o.finish_reason == 'length' else ''}")
    print(f"\n{format_stats(llm.stats)}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
