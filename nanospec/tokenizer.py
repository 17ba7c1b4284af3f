"""A tiktoken tokenizer built from the checkpoint's own files: tokenizer.json (byte-level BPE with
merges: Llama 3, Qwen 2 / 2.5 / 3, SmolLM2), a tiktoken-format tokenizer.model (Llama 3 original),
or the tokenizer metadata of a GGUF file.

How a Hugging Face BPE becomes a tiktoken Encoding: tiktoken merges, inside each pre-tokenized
piece, the adjacent pair whose concatenation has the lowest rank. Byte-level BPE merges the pair
that comes first in the merge list. So a token's rank is the position of the merge that creates it
(single bytes first), not its id; `rank_to_id` maps tiktoken's ranks back to the model's ids.
Added tokens (`<|im_start|>`, ...) become tiktoken special tokens, matched literally.
Chat prompts are rendered by the checkpoint's own template (chat_template.py) and encoded here.
"""
from __future__ import annotations

import base64
import codecs
import json
import os
import re
import unicodedata

import numpy as np
import tiktoken

from nanospec.chat_template import ChatTemplate, load_template, named_special_tokens
from nanospec.checkpoint import RANDOM_MODELS, read_json
from nanospec.errors import NanospecError, is_int, shown

# Pre-tokenizer patterns (how text is cut into pieces before BPE).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-2 after splitting every digit on its own (SmolLM2's Digits(individual_digits) + ByteLevel).
GPT2_DIGITS_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
GGUF_PRE_TOKENIZERS = {"llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN,
                       "smollm": GPT2_DIGITS_PATTERN, "gpt2": GPT2_PATTERN, "default": GPT2_PATTERN}
LLAMA3_SPECIAL_TOKENS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                          "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                          "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                         + [f"<|reserved_special_token_{3 + i}|>" for i in range(245)])
GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
STOP_TOKEN_NAMES = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>", "<|eom_id|>")
# the normalizers of tokenizer.json nanospec applies (Qwen's: NFC)
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def utf8_decoder():
    """An incremental UTF-8 decoder, as an output's text is decoded: U+FFFD for bytes that are not
    UTF-8, and the bytes of a character not yet complete held until more come."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (tokens are stored this way)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = iter(range(256, 512))   # the others, in byte order, as the characters from U+0100 on
    return {b: chr(b) if b in printable else chr(next(stand_ins)) for b in range(256)}


UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    return bytes(UNICODE_TO_BYTE[c] for c in token)


class Tokenizer:
    def __init__(self, ranked_tokens: list[tuple[bytes, int]], special_tokens: dict[str, int],
                 pattern: str, add_bos: bool = False, bos_token: str | None = None,
                 eos_tokens: tuple[str, ...] = STOP_TOKEN_NAMES, chat_template: ChatTemplate | None = None,
                 not_skipped: set[str] = frozenset(), normalize: tuple[str, ...] = ()):
        """ranked_tokens: (bytes, id) in merge order, so that list position is the BPE rank.
        special_tokens: the added tokens, matched literally in text; those in not_skipped (added but
        not special, as Qwen3's <think>) stay in a decode that skips special tokens. eos_tokens: those
        that end a generation, where special_tokens has them (default: the families' STOP_TOKEN_NAMES).
        normalize: Unicode forms (UNICODE_FORMS) the text between added tokens takes before BPE, in
        order, as tokenizer.json's normalizer (Qwen's NFC: "é" typed as e + U+0301 is encoded as é).
        chat_template: the checkpoint's (chat_template.load_template), or None for the fallback
        format the special tokens name, if any."""
        mergeable = {}
        for token, token_id in ranked_tokens:
            mergeable.setdefault(token, (len(mergeable), token_id))
        num_ranks = len(mergeable)
        specials = {s: num_ranks + i for i, s in enumerate(special_tokens)}   # tiktoken ids past the ranks
        self.encoding = tiktoken.Encoding("nanospec", pat_str=pattern,
                                          mergeable_ranks={t: r for t, (r, _) in mergeable.items()},
                                          special_tokens=specials)
        self.rank_to_id = np.array([i for _, i in mergeable.values()] + list(special_tokens.values()),
                                   dtype=np.int64)
        self.id_to_bytes = [b""] * (int(self.rank_to_id.max()) + 1)   # index: token id
        for token, (_, token_id) in mergeable.items():
            if token_id >= 0:
                self.id_to_bytes[token_id] = token
        for text, token_id in special_tokens.items():
            self.id_to_bytes[token_id] = text.encode()
        self.special_tokens = dict(special_tokens)
        self.normalize = tuple(normalize)
        # the added tokens, longest first (one that holds another wins), kept by split() as separators
        longest_first = sorted(special_tokens, key=len, reverse=True)
        self.added = (re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
                      if special_tokens and self.normalize else None)
        self.skipped_ids = frozenset(i for t, i in special_tokens.items() if t not in not_skipped)
        self.byte_in_vocab = {t[0] for t, (_, i) in mergeable.items() if len(t) == 1 and i >= 0}
        self.bos_id = special_tokens.get(bos_token) if bos_token else None
        self.add_bos = add_bos and self.bos_id is not None
        self.eos_ids = sorted({special_tokens[t] for t in eos_tokens if t in special_tokens})
        self.chat_template = chat_template or load_template(vocab_specials=special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_bytes)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ranks = self.encoding.encode(self.normalized(text), allowed_special="all")
        ids = [i for i in self.rank_to_id[ranks].tolist() if i >= 0] if ranks else []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def normalized(self, text: str) -> str:
        """text with its normalizer's forms applied between the added tokens, which are matched first
        and left as they are, as Hugging Face's tokenizers does: NFC would fold an added token's last
        ">" and a combining U+0338 after it into one character, and the token would be lost."""
        if not self.normalize:
            return text
        pieces = self.added.split(text) if self.added else [text]
        for form in self.normalize:   # odd pieces are the added tokens
            pieces = [p if i % 2 else unicodedata.normalize(form, p) for i, p in enumerate(pieces)]
        return "".join(pieces)

    def decode_bytes(self, ids: list[int], skip_special: bool = False) -> bytes:
        """skip_special: without the special tokens (an output's text by default, as transformers'
        decode(skip_special_tokens=True) and vLLM give it)."""
        skipped = self.skipped_ids if skip_special else frozenset()
        return b"".join(self.id_to_bytes[i] for i in ids if i not in skipped)

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def output_text(self, ids: list[int], skip_special: bool = True) -> str:
        """An output's text: without the special tokens, and without a last character whose bytes
        have not all come (an output cut at its length mid-character), as vLLM's detokenizer gives
        it; decode() ends such a text with U+FFFD, as transformers' does."""
        # (not final: a split character is held)
        return utf8_decoder().decode(self.decode_bytes(ids, skip_special))

    def tail(self, ids: list[int], num_bytes: int, skip_special: bool = False) -> list[int]:
        """The shortest end of ids whose bytes (as decode_bytes gives them) are at least num_bytes,
        or all of them: a token may be worth no bytes (a skipped special token)."""
        total = 0
        for start in range(len(ids) - 1, -1, -1):
            if not (skip_special and ids[start] in self.skipped_ids):
                total += len(self.id_to_bytes[ids[start]])
            if total >= num_bytes:
                return ids[start:]
        return ids

    def text_before_stop(self, ids: list[int], stops: list[str], skip_special: bool,
                         include_stop: bool) -> str | None:
        """An output's text (ids) cut at the stop string the newest token completed, before it or
        through it (include_stop); None if it completed none. Of several (a step's token may complete
        two), the one that ends first, the first listed of a tie, as vLLM chooses."""
        # A stop the newest token completed lies in its bytes and the longest stop's before them.
        num_bytes = max(len(s.encode()) for s in stops) + len(self.decode_bytes(ids[-1:], skip_special))
        tail = self.output_text(self.tail(ids, num_bytes, skip_special), skip_special)
        if not any(s in tail for s in stops):
            return None
        text = self.output_text(ids, skip_special)
        # (A stop holding U+FFFD may match only the tail's cut start: none found then.)
        found = [(start + len(s), i, start) for i, s in enumerate(stops) if (start := text.find(s)) >= 0]
        if not found:
            return None
        end, _, start = min(found)
        return text[:end if include_stop else start]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """The conversation (a list of {"role", "content"} dicts, or one string: one user message)
        rendered by the chat template, as token ids. As transformers does, the rendered text is
        encoded without adding a BOS (a template that wants one writes it) and with special tokens
        parsed."""
        if self.chat_template is None:
            raise NanospecError("this tokenizer has no chat template (no chat_template.jinja, no "
                                "chat_template in tokenizer_config.json or the GGUF metadata) and no known "
                                "chat format (Llama 3 or ChatML); give the prompt as plain text (drop "
                                "--chat)")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        text = self.chat_template.render(messages, add_generation_prompt, template_kwargs)
        return self.encode(text, add_bos=False)


def ranked_from_merges(vocab: dict[str, int], merges: list,
                       source: str = "tokenizer.json") -> list[tuple[bytes, int]]:
    """Single bytes first, then each merged token at the position of the merge that creates it."""
    # A byte missing from the vocabulary (SmolLM2 lacks a few that UTF-8 never uses) gets id -1:
    # tiktoken needs every byte, and encode drops it, as Hugging Face's BPE does without an unk token.
    ranked = [(token_bytes(c), vocab.get(c, -1)) for c in bytes_to_unicode().values()]
    for n, merge in enumerate(merges):
        pair = merge.split(" ", 1) if isinstance(merge, str) else merge
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise NanospecError(f"{source}: merge {n} is {merge!r}, not two tokens (\"left right\" or [left, "
                                "right]); re-download the tokenizer")
        left, right = pair
        if left + right in vocab:
            if any(c not in UNICODE_TO_BYTE for c in left + right):
                raise NanospecError(f"{source}: token {left + right!r} is not byte-level BPE text; only "
                                    "byte-level BPE (Llama 3, Qwen, SmolLM2 style) is supported")
            ranked.append((token_bytes(left + right), vocab[left + right]))
    return ranked


MAX_TOKEN_ID = 2**24   # far above any real vocabulary (Llama 3: 128,256; Qwen: 151,936)


def check_vocabulary(vocab, specials, source: str) -> None:
    """Token -> id maps whose ids a vocabulary can hold."""
    for what, table in (("vocabulary", vocab), ("added tokens", specials)):
        for token, token_id in table.items():
            if not (isinstance(token, str) and is_int(token_id) and 0 <= token_id < MAX_TOKEN_ID):
                raise NanospecError(f"{source}: its {what} maps {token!r} to {token_id!r}, not a token id in "
                                    f"0..{MAX_TOKEN_ID - 1}; re-download the tokenizer")


def pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The regex that cuts text into pieces before BPE: a Split step's, or byte-level BPE's own."""
    steps = (pre.get("pretokenizers") or [pre]) if isinstance(pre, dict) else []
    kinds = {s.get("type"): s for s in steps if isinstance(s, dict)}   # (malformed steps: unsupported below)
    if "Split" in kinds:
        pattern = kinds["Split"].get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            return pattern["Regex"]
        raise NanospecError(f"unsupported Split pre-tokenizer in tokenizer.json (pattern {shown(pattern)}): "
                            "only a Split by a regex (Llama 3 and Qwen's) is supported")
    if "ByteLevel" in kinds:
        digits = kinds.get("Digits", {}).get("individual_digits", False)
        return GPT2_DIGITS_PATTERN if digits else GPT2_PATTERN
    raise NanospecError(f"unsupported pre-tokenizer {shown(pre)} in tokenizer.json; only byte-level BPE "
                        "(Llama 3, Qwen, SmolLM2 style) is supported")


def normalization_forms(normalizer, source: str) -> tuple[str, ...]:
    """The Unicode forms a tokenizer.json normalizer applies (none, one, or a Sequence of them);
    any other normalizer is refused, not ignored: text would be encoded as the model never saw it."""
    if normalizer is None:
        return ()
    sequence = isinstance(normalizer, dict) and normalizer.get("type") == "Sequence"
    steps = normalizer.get("normalizers") if sequence else [normalizer]
    kinds = ([step.get("type") if isinstance(step, dict) else None for step in steps]
             if isinstance(steps, list) else [None])
    if not all(kind in UNICODE_FORMS for kind in kinds):
        raise NanospecError(f"{source}: unsupported normalizer {json.dumps(normalizer)}; nanospec applies "
                            f"only Unicode normalization ({', '.join(UNICODE_FORMS)}), as byte-level BPE "
                            "tokenizers (Llama 3, Qwen, SmolLM2) use")
    return tuple(kinds)


def from_tokenizer_json(folder: str) -> Tokenizer:
    path = os.path.join(folder, "tokenizer.json")
    data = read_json(path)
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else "no"
        raise NanospecError(f"{path} has {kind} model section; only byte-level BPE (a BPE model with vocab "
                            "and merges: Llama 3, Qwen, SmolLM2) is supported")
    vocab, merges, added = model.get("vocab"), model.get("merges"), data.get("added_tokens", [])
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        raise NanospecError(f"{path}: its BPE model lacks a vocab object or a merges list; re-download the "
                            "tokenizer")
    if not (isinstance(added, list) and all(isinstance(t, dict) for t in added)):
        raise NanospecError(f"{path}: added_tokens must be a list of objects; re-download the tokenizer")
    specials = {t.get("content"): t.get("id") for t in added}
    check_vocabulary(vocab, specials, path)
    not_special = {t.get("content") for t in added if t.get("special") is False}
    named, template = folder_template(folder, specials)
    post = json.dumps(data.get("post_processor") or {})
    bos = named.get("bos_token")   # added by the post-processor, if it names it
    return Tokenizer(ranked_from_merges(vocab, merges, path), specials,
                     pattern_from_pre_tokenizer(data.get("pre_tokenizer")),
                     add_bos=bos is not None and f'"{bos}"' in post, bos_token=bos, not_skipped=not_special,
                     normalize=normalization_forms(data.get("normalizer"), path), chat_template=template)


def folder_template(folder: str, specials: dict[str, int],
                    named: dict[str, str] | None = None) -> tuple[dict[str, str], ChatTemplate | None]:
    """The special tokens the folder's tokenizer_config.json (if any) names, over `named`, and its
    chat template (chat_template.load_template)."""
    config = read_json(os.path.join(folder, "tokenizer_config.json"), optional=True)
    named = {**(named or {}), **named_special_tokens(config)}
    return named, load_template(folder, config, special_tokens=named, vocab_specials=specials)


def from_tiktoken_model(folder: str) -> Tokenizer:
    """Llama 3's original tokenizer.model: one `base64(token) rank` per line, then 256 special tokens."""
    ranked, path = [], os.path.join(folder, "tokenizer.model")
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranked.append((base64.b64decode(token, validate=True), int(rank)))
                except ValueError as e:   # binascii.Error is a ValueError too
                    raise NanospecError(f"{path}:{n} is not a `base64-token rank` line ({e}); only Llama 3's "
                                        "tiktoken-format tokenizer.model is supported (not a SentencePiece "
                                        "one)") from e
    ranked.sort(key=lambda pair: pair[1])
    specials = {s: len(ranked) + i for i, s in enumerate(LLAMA3_SPECIAL_TOKENS)}
    _, template = folder_template(folder, specials,
                                  {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    return Tokenizer(ranked, specials, LLAMA3_PATTERN, add_bos=True, bos_token="<|begin_of_text|>",
                     chat_template=template)


def from_gguf(meta: dict) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise NanospecError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported; "
                            "only byte-level BPE ('gpt2': Llama 3, Qwen, SmolLM2) is")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise NanospecError(f"GGUF pre-tokenizer {pre!r} is not supported; known: "
                            f"{', '.join(GGUF_PRE_TOKENIZERS)}")
    tokens, types, merges = (meta.get(f"tokenizer.ggml.{key}") for key in ("tokens", "token_type", "merges"))
    if not (isinstance(tokens, list) and isinstance(types, list) and len(tokens) == len(types)
            and isinstance(merges, list)):
        raise NanospecError("the GGUF file lacks a complete tokenizer (tokenizer.ggml.tokens, token_type and "
                            "merges); re-convert the model with llama.cpp's convert_hf_to_gguf.py")
    # (a GGUF names no normalizer: transformers, which builds its tokenizer from the same keys, applies none)
    # llama.cpp's token types: 1 NORMAL, 3 CONTROL, 4 USER_DEFINED (added, not special), 6 BYTE
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (1, 6)}
    specials = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)}
    check_vocabulary(normal, specials, "the GGUF tokenizer")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    bad = [i for i in (bos_id, *eos_ids)
           if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens))]
    if bad:
        raise NanospecError(f"the GGUF tokenizer names token id {bad[0]!r} as bos/eos, outside its "
                            f"{len(tokens)} tokens; re-convert the model")
    eos = tuple(tokens[i] for i in eos_ids if i is not None)
    # The special tokens a template may name, as transformers reads them from a GGUF file.
    named = {name: tokens[i] for name, key in GGUF_SPECIAL_TOKENS.items()
             if isinstance(i := meta.get(f"tokenizer.ggml.{key}"), int) and 0 <= i < len(tokens)}
    return Tokenizer(ranked_from_merges(normal, merges, "the GGUF tokenizer"), specials,
                     GGUF_PRE_TOKENIZERS[pre], add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                     bos_token=tokens[bos_id] if bos_id is not None else None,
                     eos_tokens=eos + STOP_TOKEN_NAMES,
                     not_skipped={t for t, kind in zip(tokens, types) if kind == 4},   # USER_DEFINED
                     chat_template=load_template(gguf_metadata=meta, special_tokens=named,
                                                 vocab_specials=specials))


def byte_tokenizer(vocab_size: int = 257) -> Tokenizer:
    """The random models' tokenizer: one id per byte (0 .. 255), <|endoftext|> (256), and ids up to
    vocab_size that decode to nothing, so that a random model samples over its whole vocabulary
    (what a real one of its shapes costs)."""
    tokenizer = Tokenizer([(bytes([b]), b) for b in range(256)], {"<|endoftext|>": 256}, GPT2_PATTERN)
    tokenizer.id_to_bytes += [b""] * (vocab_size - len(tokenizer.id_to_bytes))
    return tokenizer


def load_tokenizer(path: str, gguf_metadata: dict | None = None) -> Tokenizer:
    if path.startswith("random:"):
        return byte_tokenizer(RANDOM_MODELS[path.removeprefix("random:")]["vocab_size"])
    if gguf_metadata is not None:
        return from_gguf(gguf_metadata)
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return from_tokenizer_json(path)
    if os.path.exists(os.path.join(path, "tokenizer.model")):
        return from_tiktoken_model(path)
    raise NanospecError(f"no tokenizer.json or tokenizer.model in {path}; copy the model's tokenizer files "
                        "into it")
