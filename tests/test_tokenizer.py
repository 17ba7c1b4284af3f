"""The tiktoken tokenizer encodes exactly as the reference BPE (Hugging Face `tokenizers`) does,
from tokenizer.json, from tiktoken-format tokenizer.model and from GGUF metadata, and decode
inverts encode on any text."""
import base64
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec import gguf_file
from nanospec.errors import NanospecError
from nanospec.tokenizer import (LLAMA3_PATTERN, from_gguf, from_tiktoken_model, from_tokenizer_json,
                                token_bytes)

TEXTS = ["Hello world!", "  multiple   spaces\n\n\ttabs and\r\nwindows lines",
         "digits 1234567 and 3.14159, 2,718", "unicode: héllo wörld 日本語 🙂 Ελληνικά العربية",
         "def f(x):\n    return x**2  # comment\n", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
         "I'm you'll they've WE'RE", "a" * 60, "   ", "", "x\r\ny", "emoji🙂🙂 mixed123abc",
         "\n\n\n", "tabs\t\t\tend  "]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    """Our GGUF tokenizer, and the reference: the same vocab and merges in HF tokenizers with the
    pre-tokenizer the GGUF names ('smollm': each digit alone, then GPT-2's byte-level split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    meta = gguf_file.metadata(gguf_file.open_reader(smollm2_gguf))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    ref = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    digits = pre_tokenizers.Digits(individual_digits=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ref.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens([t for t, k in zip(tokens, types) if k == 3])
    return from_gguf(meta), ref


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_reference(smollm2, text):
    ours, ref = smollm2
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids


def test_tokenizer_json_matches_reference(checkpoints):
    from tokenizers import Tokenizer
    folder = checkpoints["qwen2"]
    ours, ref = from_tokenizer_json(folder), Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


def test_llama3_split_pattern_matches_reference(checkpoints, tmp_path):
    """Llama 3 / Qwen style tokenizer.json: a Split regex, then ByteLevel without its own regex."""
    from tokenizers import Tokenizer
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = from_tokenizer_json(str(tmp_path)), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


def test_ranks_come_from_merge_order_not_ids(checkpoints, tmp_path):
    """Shuffle the ids of a vocabulary: the merge list alone decides how text splits."""
    import random
    from tokenizers import Tokenizer
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    specials = {t["id"] for t in data["added_tokens"]}
    ids = [i for i in data["model"]["vocab"].values() if i not in specials]
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    remap = dict(zip(ids, shuffled))
    data["model"]["vocab"] = {t: remap.get(i, i) for t, i in data["model"]["vocab"].items()}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = from_tokenizer_json(str(tmp_path)), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


NORMALIZED_TEXTS = ["he\u0301llo c\u0327a va", "héllo ça va", "ﬁne ２０２４ Ａ",
                    "<|im_start|>e\u0301<|im_end|>\u0338 x", ">\u0338 <\u0338", "Å Å Å", "e\u0301" * 20]


@pytest.mark.parametrize("normalizer", [
    {"type": "NFC"}, {"type": "NFKC"}, {"type": "NFD"},
    {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFC"}]},
    {"type": "Sequence", "normalizers": []}])
def test_a_unicode_normalizer_applies_before_bpe_as_the_reference(checkpoints, tmp_path, normalizer):
    """Qwen's tokenizer.json normalizes to NFC before BPE: "é" typed as e + U+0301 is encoded as é.
    Added tokens are matched first and left alone (NFC would fold a token's last ">" and a combining
    U+0338 after it into one character)."""
    from tokenizers import Tokenizer
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    data["normalizer"] = normalizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    ours, ref = from_tokenizer_json(str(tmp_path)), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in NORMALIZED_TEXTS + TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("normalizer", [
    {"type": "Lowercase"},
    {"type": "Sequence", "normalizers": [{"type": "NFC"},
                                         {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]},
    {"type": "Sequence"}, 7])
def test_another_normalizer_is_refused_not_ignored(checkpoints, tmp_path, normalizer):
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    data["normalizer"] = normalizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(NanospecError, match="unsupported normalizer"):
        from_tokenizer_json(str(tmp_path))


def test_tiktoken_model_file(checkpoints, tmp_path):
    """A tiktoken-format tokenizer.model (Llama 3 original: ids are ranks, Llama 3's pre-tokenizer)
    encodes like the reference BPE given the same vocabulary renumbered by rank."""
    from tokenizers import Tokenizer
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    ranks = from_tokenizer_json(checkpoints["qwen2"]).encoding._mergeable_ranks
    ranked = sorted(ranks.items(), key=lambda kv: kv[1])
    (tmp_path / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                      for t, r in ranked))
    rank_of = {t: r for t, r in ranked}
    data["model"]["vocab"] = {s: rank_of[token_bytes(s)] for s in data["model"]["vocab"]
                              if s not in {a["content"] for a in data["added_tokens"]}}
    data["added_tokens"] = []
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (tmp_path / "ref.json").write_text(json.dumps(data))
    ours, ref = from_tiktoken_model(str(tmp_path)), Tokenizer.from_file(str(tmp_path / "ref.json"))
    assert ours.bos_id == len(ranked) and ours.encode("hi")[0] == ours.bos_id   # Llama 3 adds BOS
    for text in TEXTS:
        if "<|" not in text:   # special tokens differ between the two files
            assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("pre", [
    {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False},   # a literal
    {"type": "Split", "behavior": "Isolated"},                                                  # no pattern
    {"type": "Sequence", "pretokenizers": [{"pattern": {"Regex": "x"}}, "ByteLevel"]},          # no types
    ["ByteLevel"], {"type": "Whitespace"}])
def test_an_unsupported_pre_tokenizer_is_one_line_naming_it(checkpoints, tmp_path, pre):
    """A pre-tokenizer nanospec cannot turn into tiktoken's pattern is refused in one line that names
    it and what is supported (a Split by a literal string was a KeyError traceback)."""
    data = json.load(open(os.path.join(checkpoints["qwen2"], "tokenizer.json")))
    data["pre_tokenizer"] = pre
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(NanospecError, match="unsupported .*pre-tokenizer.* is supported"):
        from_tokenizer_json(str(tmp_path))


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_decode_inverts_encode(smollm2, text):
    ours, _ = smollm2
    # bytes the vocabulary lacks (a few control characters) are dropped, as by the reference
    kept = "".join(c for c in text if all(b in ours.byte_in_vocab for b in c.encode()))
    assert ours.decode(ours.encode(kept)) == kept


def test_chat_template_smollm2(smollm2):
    ours, _ = smollm2
    text = ours.decode(ours.apply_chat_template("Hi!"))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert ours.eos_ids == [0, 2]


def test_token_bytes_roundtrip():
    assert token_bytes("Ġhello") == b" hello"
