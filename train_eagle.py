"""Train an EAGLE-1 or EAGLE-3 draft head for a target model; write it in the public layout.

    python train_eagle.py --out heads/smollm2-eagle1                    # SmolLM2 on a 2-core CPU, ~30 min
    python train_eagle.py --target Qwen/Qwen3-8B --arch eagle3 --device cuda --out heads/qwen3-eagle3

1. Data (self-distillation, as the EAGLE authors regenerate theirs): prompts from --data (JSON
   lines with a "prompt" field) or the built-in generated set (short questions of many kinds, then
   summaries, extraction and code edits of the target's own answers); the target answers them with
   nanospec, so the head learns the target's own distribution.
2. Features: one target forward over every prompt + answer, cached on disk (OUT/cache), so epochs
   never rerun the target. EAGLE-1 reads the last hidden state (after the final norm: what the LM head
   reads, as in the EAGLE code and vLLM); EAGLE-3 the hidden states entering three layers.
3. Training, with the published objectives. Element i of a sequence is (feature f_i, token t_{i+1})
   and its output predicts f_{i+1}, whose logits are the target's distribution of t_{i+2}.
   Both archs train with training-time test (EAGLE-3's; for EAGLE-1 too, since drafting feeds the
   head its own features after the first draft): step j feeds the head its own outputs of step j-1
   as features, with the attention pattern the drafting loop will see (real elements up to i - j,
   then the chain of predicted ones), and every step counts in the loss.
   EAGLE-1: smooth-L1 regression of f_{i+1} + 0.1 x cross-entropy against the target's distribution.
   EAGLE-3: cross-entropy over a reduced draft vocabulary (the most frequent tokens of the data;
   d2t / t2d map it to the target's). Cross-entropies are over that vocabulary for EAGLE-1 too
   (its drafts use the full one; this only makes the term cheaper).
   AdamW, linear warm-up then cosine decay, gradient clipping; a progress line with loss and
   accuracy; OUT/checkpoint.pt every --save-every steps: the same command resumes a stopped run.
4. Output: OUT/model.safetensors + OUT/config.json, which nanospec (--eagle OUT), vLLM and SGLang
   load unchanged; an EAGLE-1 head SGLang needs in its own layout, written to OUT/sglang (--export;
   docs/eagle_training.md says why). Then the head's mean acceptance length on held-out prompts
   (the shipped benchmark prompts), over all and per category, measured with the real engine, next
   to the n-gram proposer's, in OUT/train_report.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nanospec import LLM, SamplingParams
from nanospec.checkpoint import read_config, unpack_weights
from nanospec.cli import HelpFormatter, add_model_args, log_loading, set_threads
from nanospec.eagle import Eagle1Head, Eagle3Head, default_aux_layers
from nanospec.errors import NanospecError, check_int, check_real, run_command
from nanospec.stats import Stats
from nanospec.kv_cache import KVCache, build_metadata
from nanospec.model import ModelConfig

# ---- knobs (each is also a flag) ----
ARCH = "eagle1"
NUM_PROMPTS = 1000          # training prompts (generated set, or the first N of --data)
RESPONSE_TOKENS = 128       # the target's answer per prompt
DATA_TEMPERATURE = 0.0      # how the target answers (0: greedy, the decoding the head will serve)
SEQ_LEN = 512               # prompt + answer, truncated
BATCH_SIZE = 8              # sequences per optimizer step
STEPS = 900                 # optimizer steps
LR = 1e-3
WARMUP = 20
WEIGHT_DECAY = 0.0
GRAD_CLIP = 0.5
FEATURE_NOISE = 0.2         # EAGLE-1: uniform noise of this width on input features (robust to its errors)
TTT_STEPS = 3               # training-time-test depth
TOKEN_MAP = "token_map.pt"   # EAGLE-1: the loss vocabulary's ids, for --speculative-token-map
DRAFT_VOCAB = 8192          # EAGLE-3: reduced draft vocabulary; both: the vocabulary of the cross-entropy
SAVE_EVERY = 100
EVAL_K = 4
EVAL_TOKENS = 64
# the target's dtype for data, features and evaluation: auto is the engine's own default, the dtype the
# head will serve with (float32 on CPU, bfloat16 on CUDA)
DTYPE = "auto"


# ---- 1. data ----

# Subjects of the generated prompts. None is the subject of a held-out (shipped benchmark) prompt.
TOPICS = ["photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
          "compound interest", "the immune system", "volcanoes", "the printing press", "supply and demand",
          "the human heart", "electric cars", "the Roman Empire", "recycling", "vaccines", "the internet",
          "earthquakes", "sleep", "coffee", "chess", "the Olympic Games", "rainbows", "democracy",
          "plate tectonics", "antibiotics", "renewable energy", "the moon landing", "inflation", "DNA",
          "tides", "penguins", "jazz music", "the stock market", "rain forests", "ancient Egypt",
          "the Great Wall of China", "the Renaissance", "the Industrial Revolution", "the Cold War",
          "the Silk Road", "the Vikings", "ancient Greece", "the steam engine", "the telephone",
          "electricity", "magnets", "gravity", "nuclear power", "solar panels", "wind turbines", "batteries",
          "semiconductors", "smartphones", "cloud computing", "cybersecurity", "encryption",
          "open-source software", "databases", "spreadsheets", "email", "social media", "video games",
          "virtual reality", "3D printing", "robots", "drones", "self-driving cars", "airplanes",
          "high-speed trains", "container ships", "rockets", "satellites", "GPS", "the periodic table",
          "atoms", "chemical reactions", "acids and bases", "evolution", "cells", "bacteria", "viruses",
          "fungi", "the human brain", "memory", "muscles", "bones", "nutrition", "vitamins", "meditation",
          "stress", "friendship", "teamwork", "public speaking", "time management", "credit cards", "taxes",
          "banks", "cryptocurrency", "startups", "marketing", "negotiation", "job interviews", "remote work",
          "learning a new language", "museums", "photography", "painting", "sculpture", "classical music",
          "the guitar", "the piano", "opera", "film making", "theater", "poetry", "comic books",
          "board games", "football", "basketball", "tennis", "swimming", "deserts", "oceans", "coral reefs",
          "rivers", "glaciers", "hurricanes", "tornadoes", "lightning", "wolves", "elephants", "whales",
          "octopuses", "ants", "butterflies", "bird migration", "dogs", "cats", "horses", "gardening",
          "composting", "rice", "chocolate", "tea", "cheese", "spices", "Mars", "comets", "galaxies",
          "telescopes", "time zones", "maps", "writing systems", "prime numbers", "probability", "statistics",
          "geometry", "fractions", "architecture", "bridges", "skyscrapers", "public transport",
          "plastic pollution", "air pollution", "deforestation", "endangered species", "national parks",
          "tourism", "festivals", "volunteering", "elections", "the United Nations", "human rights",
          "newspapers", "advertising", "fashion", "cotton", "glass", "steel", "concrete", "salt", "sugar"]
TASKS = ["reverses a string", "checks whether a number is prime", "returns the largest element of a list",
         "computes the factorial of n", "removes duplicates from a list", "converts Celsius to Fahrenheit",
         "sums the digits of an integer", "finds the average of a list",
         "capitalizes every word in a sentence", "counts the vowels in a string", "flattens a nested list",
         "returns the even numbers of a list", "sorts a list of dictionaries by a key",
         "validates an email address", "groups words by their first letter",
         "computes the greatest common divisor of two numbers", "checks whether two strings are anagrams",
         "rotates a list by k positions", "finds the second smallest number in a list",
         "converts a binary string to an integer", "splits a list into chunks of size n",
         "transposes a matrix", "computes the dot product of two vectors",
         "checks whether the brackets in a string are balanced", "finds the longest word in a sentence",
         "converts an integer to Roman numerals", "generates all subsets of a list",
         "performs a binary search on a sorted list", "implements bubble sort",
         "counts the lines in a text file", "writes a list of dictionaries to a JSON file",
         "computes the median of a list", "finds the common elements of two lists",
         "removes the punctuation from a string", "converts seconds to hours, minutes and seconds",
         "finds the missing number in a list of 1 to n", "turns two lists into a dictionary",
         "checks the strength of a password", "generates a random password", "computes the area of a circle",
         "computes the edit distance between two strings", "finds the most common element of a list",
         "converts a string to title case", "computes the cumulative sum of a list",
         "returns the keys of a dictionary sorted by value", "checks whether a list is sorted",
         "compresses a string with run-length encoding", "converts a hex color to RGB"]
# Each template + subject is one prompt (stage 1: short questions); the math ones draw random numbers.
STAGE1 = {
    "explain": ["Explain {topic} in simple terms.", "Write a short paragraph about {topic}.",
                "What are three interesting facts about {topic}?", "Why is {topic} important?",
                "Give me a beginner's guide to {topic}.",
                "Summarize the history of {topic} in a few sentences.",
                "What is a common misconception about {topic}?", "Describe {topic} to a ten-year-old.",
                "List the pros and cons of {topic}."],
    "creative": ["Write a haiku about {topic}.", "Write a short poem about {topic}.",
                 "Write the opening of a short story that involves {topic}."],
    "structured": ["Return a JSON object about {topic} with the keys \"name\", \"summary\" and \"facts\".",
                   "Make a markdown table with three facts about {topic}."],
    "code": ["Write a Python function that {task}.",
             "Show me how to write a function that {task}, with an example.",
             "Write a JavaScript function that {task}.",
             "Explain step by step how to write code that {task}."],
    "math": ["Find x if {a}x + {b} = {c}, and show the working.", "What is {p}% of {n}? Show your work.",
             "A car travels {d} km in {h} hours. What is its average speed?",
             "A shirt costs ${n} and is discounted by {p}%. What is the new price?",
             "Compute {a} * {n} step by step."],
}
STAGE1_SHARE = {"explain": 0.4, "creative": 0.15, "structured": 0.1, "code": 0.2, "math": 0.15}
# Stage 2: the target's own stage-1 answers become the context of tasks that copy from it.
ON_TEXT = ["Summarize the text below in two sentences.\n\n{text}",
           "Give the text below a title and a one-line summary.\n\n{text}",
           "Rewrite the text below as a bulleted list.\n\n{text}",
           "Copy the first and the last sentence of the text below.\n\n{text}",
           "List the key terms in the text below, one per line.\n\n{text}",
           "Fix any grammar mistakes in the text below and return it in full.\n\n{text}"]
ON_CODE = ["Add a docstring and type hints to this code. Return the full code:\n\n{code}",
           "Rename the variables in this code to be more descriptive. Return the full code:\n\n{code}",
           "Add a comment above each step of this code. Return the full code:\n\n{code}",
           "Make this code handle empty input. Return the full code:\n\n{code}",
           "Explain what this code does, line by line:\n\n{code}"]
STAGE2_SHARE = 0.4          # of the generated prompts


def stage1_prompts(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n (kind, prompt) pairs in the STAGE1_SHARE mix: distinct template + subject pairs drawn at
    random (one repeats only once all of its kind are used), math with random numbers."""
    counts = {kind: round(n * share) for kind, share in STAGE1_SHARE.items()}
    counts["math"] = max(0, n - sum(c for kind, c in counts.items() if kind != "math"))
    prompts = [("math", rng.choice(STAGE1["math"]).format(**math_numbers(rng)))
               for _ in range(counts["math"])]
    for kind in ("explain", "creative", "structured", "code"):
        subjects = [{"task": t} for t in TASKS] if kind == "code" else [{"topic": t} for t in TOPICS]
        pairs, drawn = [t.format(**s) for t in STAGE1[kind] for s in subjects], []
        while len(drawn) < counts[kind]:
            rng.shuffle(pairs)
            drawn += pairs
        prompts += [(kind, p) for p in drawn[:counts[kind]]]
    rng.shuffle(prompts)
    return prompts[:n]


def math_numbers(rng: random.Random) -> dict:
    return dict(a=rng.randint(2, 19), b=rng.randint(1, 99), c=rng.randint(100, 300), n=rng.randint(12, 480),
                p=rng.choice([5, 10, 15, 20, 25, 30, 40, 75]), d=rng.randint(60, 900), h=rng.randint(2, 9))


def stage2_prompts(rng: random.Random, answers: list[tuple[str, str]], n: int) -> list[str]:
    """n prompts that summarize, extract from or edit the target's own stage-1 answers (kind, answer)."""
    texts = [a for kind, a in answers if kind in ("explain", "creative") and len(a) > 200]
    codes = [code_block(a) for kind, a in answers if kind == "code" and ("def " in a or "function" in a)]
    prompts = []
    for i in range(n):
        if codes and i % 3 == 2:
            prompts.append(rng.choice(ON_CODE).format(code=rng.choice(codes)))
        elif texts:
            prompts.append(rng.choice(ON_TEXT).format(text=rng.choice(texts)))
    return prompts


def code_block(answer: str) -> str:
    """The first ``` fenced block of an answer (the whole answer when it has none)."""
    parts = answer.split("```")
    return parts[1].split("\n", 1)[-1].strip() if len(parts) >= 3 else answer.strip()


def self_distill(llm: LLM, prompts: list[str], max_tokens: int, temperature: float, seed: int = 0):
    """(prompt + the target's own answer, prompt length) per prompt, generated by nanospec."""
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, chat=True)
    return ([(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outputs],
            [o.text for o in outputs])


def training_sequences(llm: LLM, data_file: str | None, n: int, max_tokens: int, temperature: float):
    """The target's answers to n prompts: the first n of --data, or the built-in set generated in two
    stages (short questions of every kind; then summaries, extraction and code edits over the
    target's own answers, like the held-out benchmark's copy-heavy prompts, sharing no text with them)."""
    if data_file:
        from nanospec.prompts import read_prompts_file
        return self_distill(llm, read_prompts_file(data_file)[:n], max_tokens, temperature)[0]
    rng = random.Random(0)
    first = stage1_prompts(rng, n - int(n * STAGE2_SHARE))
    pairs, texts = self_distill(llm, [p for _, p in first], max_tokens, temperature)
    second = stage2_prompts(rng, [(kind, t) for (kind, _), t in zip(first, texts)], n - len(first))
    return pairs + self_distill(llm, second, max_tokens, temperature, seed=len(first))[0]


# ---- 2. features, cached ----

@torch.inference_mode()
def target_features(llm: LLM, sequences: list[list[int]], aux_layers: tuple[int, ...],
                    batch_tokens: int = 4096):
    """For each sequence: its final hidden states [n, H] and, for EAGLE-3, the concatenated hidden
    states entering aux_layers [n, 3H], from one prefill forward of the target (float16 on the host)."""
    model, cfg, device = llm.model, llm.config, llm.device
    finals, auxes = [], []
    block_size = 16
    for group in batches_by_tokens(sequences, batch_tokens):
        lens = [len(s) for s in group]
        cache = KVCache(cfg.num_layers, sum(-(-n // block_size) for n in lens), block_size, cfg.num_kv_heads,
                        cfg.head_dim, next(model.parameters()).dtype, device)
        tables = []
        for n in lens:
            tables.append([])
            cache.allocator.grow(tables[-1], n)
        meta = build_metadata(tables, [0] * len(lens), lens, block_size, device)
        ids = torch.tensor([t for s in group for t in s], device=device)
        hidden, captured = model(ids, meta.positions, cache, meta, aux_layers)
        aux = torch.cat(captured, dim=-1) if aux_layers else None
        for piece in hidden.split(lens):
            finals.append(piece.half().cpu())
        if aux is not None:
            for piece in aux.split(lens):
                auxes.append(piece.half().cpu())
    return finals, auxes or None


def batches_by_tokens(sequences, max_tokens):
    group, total = [], 0
    for s in sequences:
        if group and total + len(s) > max_tokens:
            yield group
            group, total = [], 0
        group.append(s)
        total += len(s)
    if group:
        yield group


def build_dataset(args, llm: LLM, aux_layers) -> dict:
    """Self-distilled sequences and their target features, from OUT/cache when already computed."""
    # The built-in prompts' recipe is part of the key: a cache from another recipe is not these data.
    recipe = None if args.data else [TOPICS, TASKS, STAGE1, STAGE1_SHARE, ON_TEXT, ON_CODE, STAGE2_SHARE]
    key_fields = [llm.target_name, str(llm.dtype), args.data, recipe, args.num_prompts, args.response_tokens,
                  args.data_temperature, args.seq_len, list(aux_layers)]
    key = hashlib.sha256(json.dumps(key_fields).encode()).hexdigest()[:16]
    path = os.path.join(args.out, "cache", f"features-{key}.pt")
    if os.path.exists(path):
        print(f"features: cached in {path}")
        return torch.load(path, weights_only=True)
    start = time.perf_counter()
    pairs = training_sequences(llm, args.data, args.num_prompts, args.response_tokens, args.data_temperature)
    gen_s = time.perf_counter() - start
    kept = [(s[:args.seq_len], p) for s, p in pairs if p < min(len(s), args.seq_len)]   # an answer token fits
    if not kept:
        raise NanospecError("no prompt leaves room for an answer token within --seq-len "
                            f"{args.seq_len}; raise it")
    seqs = [s for s, _ in kept]
    print(f"data: {len(pairs)} prompts answered by the target, {sum(map(len, seqs))} tokens in {gen_s:.0f} s"
          + (f" ({len(pairs) - len(kept)} left out: their prompt fills --seq-len)"
             if len(kept) < len(pairs) else ""))
    start = time.perf_counter()
    finals, auxes = target_features(llm, seqs, aux_layers)
    print(f"features: {time.perf_counter() - start:.0f} s")
    data = {"tokens": [torch.tensor(s) for s in seqs], "prompt_lens": [p for _, p in kept], "final": finals,
            "aux": auxes, "generation_seconds": gen_s}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(data, path)
    return data


# ---- 3. the head and its training forward ----

# What the engines read (docs/eagle_training.md has the sources): vLLM 0.32 takes the method from
# its command line and renames `architectures` (LlamaForCausalLM -> EagleLlamaForCausalLM or
# Eagle3LlamaForCausalLM; LlamaForCausalLMEagle3 kept; LlamaForCausalLMEagle unknown), its EAGLE-1
# fc has no bias; SGLang picks the class by `architectures` alone (LlamaForCausalLMEagle,
# LlamaForCausalLMEagle3) and its EAGLE-1 fc always has one. So an EAGLE-1 head trains without a
# bias and SGLang's copy gets a zero one and its own name; EAGLE-3's one file serves both.
ARCHITECTURES = {("eagle1", "vllm"): "LlamaForCausalLM", ("eagle1", "sglang"): "LlamaForCausalLMEagle",
                 ("eagle3", "vllm"): "LlamaForCausalLMEagle3", ("eagle3", "sglang"): "LlamaForCausalLMEagle3"}


def head_config(target: ModelConfig, arch: str, draft_vocab: int, aux_layers,
                trained_dtype: str | None = None) -> dict:
    """config.json of the head: a one-layer Llama with the target's shapes (the public layouts), and
    the dtype of the target whose features it learned (the engine warns when it serves another).
    EAGLE-3's layers are written in both engines' fields, each in its own meaning (eagle.py's
    aux_layers): top-level for vLLM (the states entering them), eagle_config for SGLang (the
    outputs of the layers before)."""
    cfg = {"architectures": [ARCHITECTURES[arch, "vllm"]], "model_type": "llama",
           "hidden_size": target.hidden_size, "intermediate_size": target.intermediate_size,
           "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
           "head_dim": target.head_dim, "num_hidden_layers": 1, "rms_norm_eps": target.rms_norm_eps,
           "rope_theta": target.rope_theta, "max_position_embeddings": target.max_position_embeddings,
           "vocab_size": target.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
           "bos_token_id": target.bos_token_id, "eos_token_id": target.eos_token_ids}
    if target.rope_scaling:
        cfg["rope_scaling"] = target.rope_scaling
    if arch == "eagle3":
        cfg["draft_vocab_size"] = draft_vocab
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers]}
    if trained_dtype:
        cfg["trained_target_dtype"] = trained_dtype
    return cfg


def new_head(target_config: ModelConfig, cfg: dict, draft_vocab: int):
    config = read_config({**cfg, "architectures": ["LlamaForCausalLM"]})
    if "draft_vocab_size" not in cfg:
        return Eagle1Head(config, fc_bias=False)   # vLLM's EAGLE-1 fc has none (see ARCHITECTURES)
    return Eagle3Head(config, target_config.hidden_size, draft_vocab, target_config.vocab_size)


def project(attn, x, rotary, positions):
    """q, k, v of the head's attention for x [B, T, in]: [B, heads, T, head_dim] (k, v: kv heads)."""
    b, t, _ = x.shape
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = rotary(q.reshape(b * t, attn.num_heads, attn.head_dim), positions)
    k = rotary(k.reshape(b * t, attn.num_kv_heads, attn.head_dim), positions)
    q, k = q.view(b, t, attn.num_heads, -1), k.view(b, t, attn.num_kv_heads, -1)
    v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def shift(x, n: int):
    """x [B, h, T, d] moved n places later along T (index i holds x[i - n]; the first n are zero)."""
    return x if n == 0 else F.pad(x, (0, 0, n, 0))[:, :, :x.shape[2]]


def ttt_attention(attn, x, rotary, positions, past: list):
    """Attention at training-time-test step j = len(past) (0: plain causal attention). The element
    at index i attends to the real elements (step 0) up to i - j and to the chain that produced it,
    step s's element at i - j + s for s = 1..j (itself last): what drafting step j + 1 sees in the
    head's KV cache. Returns the output [B, T, heads * d] and this step's (k, v) for later steps."""
    q, k, v = project(attn, x, rotary, positions)
    j, t = len(past), x.shape[1]
    group = attn.num_heads // attn.num_kv_heads
    widen = lambda kv: kv.repeat_interleave(group, dim=1)
    k0, v0 = (k, v) if j == 0 else past[0]
    idx = torch.arange(t, device=x.device)
    scale = attn.head_dim ** -0.5
    unseen = idx[None, :] > idx[:, None] - j   # [T, T]: the real elements after i - j
    scores = [(q @ widen(k0).transpose(-1, -2) * scale).masked_fill(unseen, float("-inf"))]
    chain = []   # step s's keys / values moved j - s places later: index i holds step s's element i - j + s
    for s, (ks, vs) in enumerate(past[1:] + [(k, v)] if j else [], start=1):
        ks, vs = shift(ks, j - s), shift(vs, j - s)
        diagonal = (q * widen(ks)).sum(-1, keepdim=True) * scale
        scores.append(diagonal.masked_fill((idx < j - s)[:, None], float("-inf")))   # no such element
        chain.append((ks, vs))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)   # every row sees at least itself
    out = probs[..., :t] @ widen(v0)
    for n, (ks, vs) in enumerate(chain):
        out = out + probs[..., t + n:t + n + 1] * widen(vs)
    b = x.shape[0]
    return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


def eagle1_forward(head, embeds, features, positions, past: list):
    """One training-time-test step of Eagle1Head.forward, dense over a padded batch [B, T, H];
    appends this step's (k, v) to past (step 0: past empty, plain causal attention)."""
    layer = head.layers[0]
    x = head.fc(torch.cat([embeds, features], dim=-1))
    attended, kv = ttt_attention(layer.self_attn, x, head.rotary, positions, past)
    past.append(kv)
    x = x + attended
    return x + layer.mlp(layer.post_attention_layernorm(x))


def eagle3_forward(head, embeds, features, positions, past: list):
    """One training-time-test step of Eagle3Head.forward; appends this step's (k, v) to past."""
    m = head.midlayer
    if features.shape[-1] != head.config.hidden_size:
        features = head.fc(features)
    both = torch.cat([m.input_layernorm(embeds), m.hidden_norm(features)], dim=-1)
    attended, kv = ttt_attention(m.self_attn, both, head.rotary, positions, past)
    past.append(kv)
    x = features + attended
    return x + m.mlp(m.post_attention_layernorm(x))


# ---- training ----

@dataclasses.dataclass
class Batch:
    embeds: torch.Tensor       # [B, T, H] embedding of t_{i+1} for element i
    features: torch.Tensor     # [B, T, H or 3H] f_i
    next_final: torch.Tensor   # [B, T, H] the target's final hidden at i + 1 (logits of t_{i+2})
    mask: torch.Tensor         # [B, T] element trains (inside the sequence, predicting an answer token)
    positions: torch.Tensor    # [B * T]


def make_batch(data, rows: list[int], llm: LLM, arch: str, device) -> Batch:
    n = max(len(data["tokens"][r]) - 1 for r in rows)   # elements 0 .. len - 2
    embed = llm.model.model.embed_tokens
    h = llm.config.hidden_size
    feats = data["aux"] if arch == "eagle3" else data["final"]
    embeds = torch.zeros(len(rows), n, h, device=device)
    features = torch.zeros(len(rows), n, feats[rows[0]].shape[-1], device=device)
    next_final = torch.zeros(len(rows), n, h, device=device)
    mask = torch.zeros(len(rows), n, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        tokens, m = data["tokens"][r].to(device), len(data["tokens"][r]) - 1
        with torch.no_grad():
            embeds[b, :m] = embed(tokens[1:]).float()
        features[b, :m] = feats[r][:-1].float()
        next_final[b, :m] = data["final"][r][1:].float()
        # element i predicts t_{i+2}, the target's output at position i + 1: train where that is an answer
        # token
        mask[b, max(0, data["prompt_lens"][r] - 2):m] = True
    positions = torch.arange(n, device=device).repeat(len(rows))
    return Batch(embeds, features, next_final, mask, positions)


def soft_cross_entropy(logits, target_probs):
    """-sum_v p(v) log q(v) averaged over rows; and how often argmax q == argmax p."""
    loss = -(target_probs * torch.log_softmax(logits, dim=-1)).sum(-1)
    return loss.mean(), (logits.argmax(-1) == target_probs.argmax(-1)).float().mean()


def next_input_features(predicted):
    """Training-time test: element i's next feature input is element i - 1's output (the chain)."""
    return torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)


def training_time_test(step_forward, batch: Batch, features, ttt_steps: int, target_probs, loss_of):
    """Run the head ttt_steps times, step j on step j - 1's outputs; element i counts at step j
    when its chain starts at a real element (i >= j). loss_of(predicted rows, target_probs rows,
    mask) -> (loss, top-1 agreement). Returns the mean loss over steps and the stats."""
    past, total, stats = [], 0.0, {}
    index = torch.arange(batch.mask.shape[1], device=batch.mask.device).expand_as(batch.mask)
    for j in range(ttt_steps):
        predicted = step_forward(features, past)
        mask = batch.mask & (index >= j)
        loss, agree = loss_of(predicted[mask], target_probs[mask[batch.mask]], mask)
        total = total + loss / ttt_steps
        stats[f"acc{j}"] = agree.item()
        features = next_input_features(predicted)
    return total, stats


def target_distribution(llm, batch: Batch, vocab_weight):
    """The target's next-token distribution at the trained elements, over the loss vocabulary."""
    with torch.no_grad():
        return torch.softmax(F.linear(batch.next_final[batch.mask], vocab_weight).float(), dim=-1)


def eagle1_loss(head, llm, batch: Batch, noise: float, ttt_steps: int, vocab_weight):
    """Smooth-L1 regression of the next feature + 0.1 x cross-entropy of its logits (the target's
    LM head over the loss vocabulary) against the target's distribution, at every TTT step."""
    features = batch.features + (torch.rand_like(batch.features) - 0.5) * noise if noise else batch.features

    def loss_of(predicted, target_probs, mask):
        regression = F.smooth_l1_loss(predicted, batch.next_final[mask])   # mean over rows and dims
        ce, agree = soft_cross_entropy(F.linear(predicted, vocab_weight).float(), target_probs)
        return regression + 0.1 * ce, agree

    step = lambda feats, past: eagle1_forward(head, batch.embeds, feats, batch.positions, past)
    target_probs = target_distribution(llm, batch, vocab_weight)
    return training_time_test(step, batch, features, ttt_steps, target_probs, loss_of)


def eagle3_loss(head, llm, batch: Batch, ttt_steps: int, vocab_weight):
    """Cross-entropy of the head's own LM head (the draft vocabulary) at every TTT step."""
    def loss_of(predicted, target_probs, mask):
        return soft_cross_entropy(head.lm_head(head.norm(predicted)).float(), target_probs)

    step = lambda feats, past: eagle3_forward(head, batch.embeds, feats, batch.positions, past)
    target_probs = target_distribution(llm, batch, vocab_weight)
    return training_time_test(step, batch, batch.features, ttt_steps, target_probs, loss_of)


def draft_vocabulary(data, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the answers (target ids, ascending): EAGLE-3's draft vocabulary,
    EAGLE-1's token map."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens, p in zip(data["tokens"], data["prompt_lens"]):
        counts += torch.bincount(tokens[p:], minlength=vocab_size)
    return torch.sort(torch.topk(counts, min(size, vocab_size)).indices).values


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX-512 BF16 or AMX, through oneDNN).
    NANOSPEC_NATIVE_BF16=0 answers no, to run what a CPU without it runs."""
    if os.environ.get("NANOSPEC_NATIVE_BF16") == "0":
        return False
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)   # private: guarded
    return bool(native is not None and native())


def train(args, llm: LLM, head, data, vocab_ids) -> dict:
    device = llm.device
    # the target's LM head over the loss vocabulary
    vocab_weight = llm.model.lm_head.weight.detach()[vocab_ids].float()
    train_rows = list(range(len(data["tokens"])))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    step, history = 0, []
    if os.path.exists(ckpt_path):
        state = load_training_checkpoint(ckpt_path)
        if state["args"] != training_args(args):
            raise NanospecError(f"{ckpt_path} is from a run with other settings; use another --out, "
                                "or delete it to start over")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        step, history = state["step"], state["history"]
        print(f"resuming from {ckpt_path} at step {step}")
    rng = random.Random(args.seed)
    order = []
    for _ in range(step):   # replay the sampling so that a resumed run sees the same batches
        order = next_rows(rng, order, train_rows, args.batch_size)[1]
    # Where the target runs in bfloat16 (the device computes it natively), so do the head's matmuls
    # (autocast: 1.5x the float32 step on this CPU); its weights and optimizer stay float32.
    mixed = llm.dtype == torch.bfloat16
    start = time.perf_counter()
    while step < args.steps:
        rows, order = next_rows(rng, order, train_rows, args.batch_size)
        batch = make_batch(data, rows, llm, args.arch, device)
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
            if args.arch == "eagle1":
                loss, stats = eagle1_loss(head, llm, batch, args.feature_noise, args.ttt_steps, vocab_weight)
            else:
                loss, stats = eagle3_loss(head, llm, batch, args.ttt_steps, vocab_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        step += 1
        history.append({"step": step, "loss": round(loss.item(), 5),
                        **{k: round(v, 4) for k, v in stats.items()}})
        progress(step, args.steps, history, start)
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "history": history, "args": training_args(args),
                        "torch_rng": torch.get_rng_state()}, ckpt_path)
    print()
    return {"steps": step, "seconds_this_run": round(time.perf_counter() - start, 1), "history": history}


def load_training_checkpoint(path: str) -> dict:
    """OUT/checkpoint.pt: tensors, numbers and strings only (weights_only: a planted file cannot run code)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise NanospecError(f"{path} is not a training checkpoint of train_eagle.py ({type(e).__name__}); "
                            "delete it to start over, or use another --out") from e
    required = {"head", "optimizer", "step", "history", "args", "torch_rng"}
    if not (isinstance(state, dict) and required <= set(state)):
        raise NanospecError(f"{path} is not a training checkpoint of train_eagle.py; "
                            "delete it or use another --out")
    return state


def next_rows(rng, order, rows, batch_size):
    """The next batch of a shuffled pass over the data (a new shuffle when one runs out)."""
    if len(order) < batch_size:
        fresh = list(rows)
        rng.shuffle(fresh)
        order = order + fresh
    return order[:batch_size], order[batch_size:]


def progress(step, total, history, start):
    recent = history[-20:]
    loss = sum(h["loss"] for h in recent) / len(recent)
    acc = sum(h["acc0"] for h in recent) / len(recent)
    bar = "#" * int(30 * step / total)
    sys.stdout.write(f"\r[{bar:<30}] step {step}/{total} loss {loss:.4f} top-1 agreement {acc:.3f} "
                     f"({time.perf_counter() - start:.0f} s)")
    sys.stdout.flush()


def training_args(args) -> dict:
    keys = ["arch", "num_prompts", "response_tokens", "data_temperature", "seq_len", "batch_size", "steps",
            "lr", "warmup", "weight_decay", "grad_clip", "feature_noise", "ttt_steps", "draft_vocab", "seed",
            "data", "target", "dtype"]
    return {k: getattr(args, k) for k in keys}


# ---- 4. output and evaluation ----

def save_head(args, head, cfg: dict) -> None:
    """OUT: the head as vLLM (and nanospec) read it; for EAGLE-1 with --export sglang or both, also
    SGLang's layout (in OUT itself for --export sglang, else in OUT/sglang). No embedding: every
    engine takes the target's (vLLM would keep a saved one apart unless equal to the target's)."""
    # floating tensors in float32; d2t, t2d (ints) as they are
    state = {k: (v.float() if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in
             unpack_weights(head.state_dict(), head.config).items() if not k.startswith("rotary.")}
    writes = []   # (folder, tensors, config)
    if args.arch == "eagle3" or args.export != "sglang":   # vLLM's, and for EAGLE-3 every engine's
        writes.append((args.out, state, cfg))
    if args.arch == "eagle1" and args.export != "vllm":
        folder = os.path.join(args.out, "sglang") if args.export == "both" else args.out
        # SGLang's fc has a bias: a zero one
        writes.append((folder, {**state, "fc.bias": torch.zeros(head.config.hidden_size)},
                       {**cfg, "architectures": [ARCHITECTURES["eagle1", "sglang"]]}))
    for folder, files, config in writes:
        os.makedirs(folder, exist_ok=True)
        save_file(files, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def acceptance_length(target: str | None, prompts: list[dict], k: int, max_tokens: int, device: str,
                      dtype: str, **proposer) -> dict:
    """Mean acceptance length at K = k, T = 0 with the real engine, over the prompts ({"prompt",
    "category"}) and per category: one generate call per category, their stats added up."""
    llm = LLM(target, device=device, dtype=dtype, num_speculative_tokens=k, **proposer)
    total, per_category = Stats(), {}
    for category in dict.fromkeys(r["category"] for r in prompts):
        group = [r["prompt"] for r in prompts if r["category"] == category]
        llm.generate(group, SamplingParams(temperature=0, max_tokens=max_tokens), chat=True)
        per_category[category] = llm.stats["mean_acceptance_length"]
        total.add(llm.engine.stats)
    s = total.as_dict()
    return {"mean_acceptance_length": s["mean_acceptance_length"],
            "acceptance_rate_per_position": s["acceptance_rate_per_position"], "per_category": per_category}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def evaluate(args, dtype: str) -> dict:
    """The head served by the engine on the held-out prompts, in the dtype it was trained in."""
    from nanospec.prompts import shipped_prompts
    held_out = shipped_prompts()
    start = time.perf_counter()
    run = lambda **proposer: acceptance_length(args.target, held_out, args.eval_k, args.eval_tokens,
                                               args.device, dtype, **proposer)
    result = {"held_out_prompts": len(held_out), "k": args.eval_k, "max_tokens": args.eval_tokens,
              "dtype": dtype, "eagle": run(eagle=args.out), "ngram": run(ngram=True)}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


@torch.no_grad()
def teacher_forced_agreement(llm: LLM, head, arch: str, aux_layers, prompts: list[str], max_tokens: int):
    """How often the head's first draft (real features: TTT step 0) is the target's next token, over
    the answer positions of the target's greedy answers to `prompts`: training's own procedure
    (self_distill, target_features, make_batch, the training forward), no engine, the full
    vocabulary. Returns (over every position, over positions right after a miss): the engine
    starts a step, and drafts its d_1, mostly right after a rejected draft."""
    pairs = self_distill(llm, prompts, max_tokens, temperature=0.0)[0]
    seqs = [s for s, _ in pairs]
    finals, auxes = target_features(llm, seqs, aux_layers)
    data = {"tokens": [torch.tensor(s) for s in seqs], "prompt_lens": [p for _, p in pairs],
            "final": finals, "aux": auxes}
    forward = eagle3_forward if arch == "eagle3" else eagle1_forward
    hits = counted = hits_after_miss = after_miss = 0
    for first in range(0, len(seqs), 8):
        rows = list(range(first, min(first + 8, len(seqs))))
        batch = make_batch(data, rows, llm, arch, llm.device)
        predicted = forward(head, batch.embeds, batch.features, batch.positions, [])       # [B, T, H]
        drafts = head.logits(predicted.flatten(0, 1), llm.model)[:, :llm.engine.vocab_size].argmax(-1)
        # element i predicts t_{i+2}; the last element's token was never generated (-1: left out)
        width = batch.mask.shape[1]
        nxt = torch.stack([F.pad(data["tokens"][r][2:], (0, width + 2 - len(data["tokens"][r])), value=-1)
                           for r in rows]).to(llm.device)
        valid = batch.mask & (nxt >= 0)
        hit = valid & (drafts.view_as(nxt) == nxt)
        follows_miss = valid[:, 1:] & valid[:, :-1] & ~hit[:, :-1]
        hits, counted = hits + int(hit.sum()), counted + int(valid.sum())
        hits_after_miss += int((hit[:, 1:] & follows_miss).sum())
        after_miss += int(follows_miss.sum())
    return hits / max(counted, 1), hits_after_miss / max(after_miss, 1)


def held_out_gap(llm: LLM, head, args, aux_layers, evaluation: dict, history: list[dict]) -> dict:
    """Separates the two causes of a gap between training agreement and held-out acceptance.
    teacher-forced: training's procedure on the held-out prompts; engine: the served head's
    first-draft acceptance on the same prompts (T = 0, so the same answers). Equal: the gap is the
    data (the head generalizes no better); different: training and drafting still differ (a bug)."""
    from nanospec.prompts import shipped_prompts
    head.eval()
    prompts = [r["prompt"] for r in shipped_prompts()]
    teacher, after_miss = teacher_forced_agreement(llm, head, args.arch, aux_layers, prompts,
                                                   args.eval_tokens)
    engine = evaluation["eagle"]["acceptance_rate_per_position"][0]
    last = history[-20:]
    return {"training_top1_step0_loss_vocabulary": round(sum(h["acc0"] for h in last) / len(last), 4),
            "held_out_teacher_forced_top1": round(teacher, 4),
            "held_out_teacher_forced_top1_after_a_miss": round(after_miss, 4),
            "held_out_engine_first_draft_acceptance": engine}


def print_evaluation(e: dict) -> None:
    print(f"held-out acceptance length at K={e['k']}, T=0 ({e['dtype']}): EAGLE "
          f"{e['eagle']['mean_acceptance_length']:.2f}, n-gram {e['ngram']['mean_acceptance_length']:.2f}")
    for category, al in e["eagle"]["per_category"].items():
        print(f"  {category:<12} EAGLE {al:.2f}  n-gram {e['ngram']['per_category'][category]:.2f}")
    if "gap" in e:
        g = e["gap"]
        print(f"top-1 of the first draft: training {g['training_top1_step0_loss_vocabulary']:.3f} "
              f"(its loss vocabulary), held out teacher-forced {g['held_out_teacher_forced_top1']:.3f} "
              f"({g['held_out_teacher_forced_top1_after_a_miss']:.3f} right after a miss), "
              f"held out in the engine {g['held_out_engine_first_draft_acceptance']:.3f}")


def build_parser():
    ap = argparse.ArgumentParser(prog="python train_eagle.py", description=__doc__.splitlines()[0],
                                 epilog="example:\n  python train_eagle.py --out heads/smollm2-eagle1",
                                 formatter_class=HelpFormatter)
    add_model_args(ap, dtype=DTYPE, dtype_help=(
        "the target's dtype for the data, the features and the evaluation: serve the head "
        "with the same (auto: the engine's default, float32 on CPU and bfloat16 on CUDA; bfloat16 trains 2x "
        "faster on a CPU with native bfloat16, then serve with --dtype bfloat16); the head "
        "keeps float32 weights"))
    ap.add_argument("--out", required=True,
                    help="folder for the head (and cache/, checkpoint.pt, train_report.json)")
    ap.add_argument("--arch", choices=["eagle1", "eagle3"], default=ARCH, help="the head's architecture")
    ap.add_argument("--export", choices=["vllm", "sglang", "both"], default="both",
                    help="the engines the files are for: an EAGLE-3 head's one file serves "
                         "all; an EAGLE-1 head needs SGLang's own layout (in OUT/sglang with both; "
                         "nanospec loads either)")
    ap.add_argument("--data", metavar="FILE.jsonl",
                    help="JSON lines with a 'prompt' field (default: the built-in generated prompts)")
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS, metavar="N",
                    help="training prompts (the generated set, or the first N of --data)")
    ap.add_argument("--response-tokens", type=int, default=RESPONSE_TOKENS, metavar="N",
                    help="tokens of the target's answer per prompt")
    ap.add_argument("--data-temperature", type=float, default=DATA_TEMPERATURE, metavar="T",
                    help="how the target answers (0: greedy, the decoding the head will serve)")
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, metavar="N",
                    help="prompt + answer tokens, truncated")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, metavar="N",
                    help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=STEPS, metavar="N", help="optimizer steps")
    ap.add_argument("--lr", type=float, default=LR, help="peak learning rate (AdamW)")
    ap.add_argument("--warmup", type=int, default=WARMUP, metavar="N",
                    help="steps of linear warm-up before the cosine decay")
    ap.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="AdamW weight decay")
    ap.add_argument("--grad-clip", type=float, default=GRAD_CLIP, help="gradient norm clip")
    ap.add_argument("--feature-noise", type=float, default=FEATURE_NOISE,
                    help="EAGLE-1: uniform noise of this width on the input features")
    ap.add_argument("--ttt-steps", type=int, default=TTT_STEPS, metavar="N",
                    help="training-time-test depth: steps the head is fed its own features")
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, metavar="N",
                    help="EAGLE-3's reduced draft vocabulary, EAGLE-1's token map (OUT/token_map.pt); for "
                         "both, the cross-entropy's vocabulary")
    ap.add_argument("--save-every", type=int, default=SAVE_EVERY, metavar="N",
                    help="write OUT/checkpoint.pt every N steps (the same command resumes)")
    ap.add_argument("--eval-k", type=int, default=EVAL_K, metavar="K",
                    help="K of the held-out acceptance measurement")
    ap.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, metavar="N",
                    help="tokens per held-out prompt in the acceptance measurement")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance measurement")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the data order and the head's initialization")
    return ap


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def check_args(args) -> None:
    for name in ("num_prompts", "response_tokens", "seq_len", "batch_size", "steps", "save_every",
                 "ttt_steps", "draft_vocab"):
        if getattr(args, name) < 1:
            raise NanospecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        raise NanospecError(f"--warmup must be in 0..steps-1, got {args.warmup}")
    check_real(args.lr, "--lr", above=0)
    check_real(args.grad_clip, "--grad-clip", above=0)
    for name in ("weight_decay", "feature_noise", "data_temperature"):
        check_real(getattr(args, name), f"--{name.replace('_', '-')}", low=0)
    check_int(args.eval_k, "--eval-k", low=1, high=16)
    check_int(args.eval_tokens, "--eval-tokens", low=1)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise NanospecError(f"--out {args.out} is a file: give a folder for the head")


def run(args) -> dict:
    check_args(args)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    set_threads(args.threads)
    wall = time.perf_counter()
    log_loading(args.target)
    llm = LLM(args.target, device=args.device, dtype=args.dtype, max_num_seqs=256)
    dtype = dtype_name(llm.dtype)   # one setting for the data, the features and the evaluation
    for p in llm.model.parameters():
        p.requires_grad_(False)
    aux_layers = default_aux_layers(llm.config.num_layers) if args.arch == "eagle3" else ()
    data = build_dataset(args, llm, aux_layers)
    # The loss vocabulary: EAGLE-3's draft vocabulary; for EAGLE-1 (which drafts with the target's LM
    # head) it makes the cross-entropy ~6x cheaper, and is saved as the token map it may draft among.
    vocab_ids = draft_vocabulary(data, llm.config.vocab_size, args.draft_vocab).to(llm.device)
    draft_ids = vocab_ids if args.arch == "eagle3" else None
    cfg = head_config(llm.config, args.arch, len(vocab_ids), aux_layers, dtype)
    head = new_head(llm.config, cfg, len(vocab_ids)).to(llm.device)
    if draft_ids is not None:   # draft id d is target id d + d2t[d]; t2d marks the target ids it covers
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=llm.device))
        head.t2d.zero_()
        head.t2d[draft_ids] = True
    report = {"command": "python train_eagle.py " + " ".join(sys.argv[1:]), "args": training_args(args),
              "dtype": dtype, "sequences": len(data["tokens"]),
              "tokens": int(sum(len(t) for t in data["tokens"]))}
    report["training"] = train(args, llm, head, data, vocab_ids)
    save_head(args, head, cfg)
    use = f"--eagle {args.out}"
    if args.arch == "eagle1":   # its loss vocabulary, as a token map (SGLang's FR-Spec format)
        torch.save(vocab_ids.cpu(), os.path.join(args.out, TOKEN_MAP))
        use += f", and --speculative-token-map {os.path.join(args.out, TOKEN_MAP)} to draft among those ids"
    print(f"wrote the EAGLE-{args.arch[-1]} head to {args.out} (use it with {use})")
    report["train_wall_seconds"] = round(time.perf_counter() - wall, 1)
    if not args.no_eval:
        report["eval"] = evaluate(args, dtype)
        report["eval"]["gap"] = held_out_gap(llm, head, args, aux_layers, report["eval"],
                                             report["training"]["history"])
        print_evaluation(report["eval"])
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)   # progress shows up in a log file too
    return run_command(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
