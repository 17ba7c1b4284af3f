"""A chat prompt is the checkpoint's own Jinja template, found where transformers finds it
(chat_template.jinja, tokenizer_config.json, GGUF metadata) and rendered as transformers renders it:
for every family and conversation shape, nanospec's token ids are transformers'
`apply_chat_template(messages, tokenize=True, add_generation_prompt=True)` ids. A checkpoint
without any template still gets its family's bare format, and a conversation of the wrong shape or
one the template refuses is one clear line.

The family templates are the real ones (tests/data/README.md says where each comes from), given to
tiny trained tokenizers that carry the family's special tokens. GLM-4.5's is written in the style
that relies on the environment's trim_blocks and lstrip_blocks, so a renderer without them fails."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import greedy, train_tokenizer
from nanospec import LLM, NanospecError
from nanospec import gguf_file
from nanospec.tokenizer import from_gguf, load_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "data")
SYSTEM = {"role": "system", "content": "You are terse. Answer in one line. "}
USER = {"role": "user", "content": "What is 12 + 30? Say it in words, héllo 🙂"}
ASSISTANT = {"role": "assistant", "content": " Forty-two.\n"}
THINKING = {"role": "assistant", "content": "<think>\nAdd the tens, then the ones.\n</think>\n\nForty-two."}
AGAIN = {"role": "user", "content": "And in French?"}
CONVERSATIONS = {"single turn": [USER], "single turn, system": [SYSTEM, USER],
                 "multi-turn": [USER, ASSISTANT, AGAIN],
                 "multi-turn, system": [SYSTEM, USER, ASSISTANT, AGAIN],
                 "multi-turn, reasoning": [SYSTEM, USER, THINKING, AGAIN]}

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# template file, special tokens added to the tiny tokenizer, tokenizer_config.json's named tokens
FAMILIES = {
    "llama3.1": ("llama3.1-instruct.jinja", LLAMA3_SPECIALS,
                 {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "llama3.2": ("llama3.2-instruct.jinja", LLAMA3_SPECIALS,
                 {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2.5": ("qwen2.5-instruct.jinja", [],
                {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": ("qwen3.jinja", [],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "glm4.5": ("glm4.5.jinja",
               ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
               {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
}
# their templates read enable_thinking, <think> tags are tokens, content may be text parts
THINKING_FAMILIES = ("qwen3", "glm4.5")
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def read(name: str) -> str:
    """A template in tests/data."""
    return read_text(os.path.join(DATA, name))


def edit_json(path: str, **fields):
    data = json.load(open(path))
    data.update(fields)
    json.dump(data, open(path, "w"))


def write_family_tokenizer(folder: str, family: str, with_template: bool = True) -> str:
    """A tiny trained byte-level BPE with the family's special tokens (Llama's tokenizer.json adds
    BOS in its post-processor, as the real one does; <think> tags are plain added tokens),
    and tokenizer_config.json holding the family's real chat template."""
    from tokenizers import processors
    template, specials, named = FAMILIES[family]
    tok = train_tokenizer()
    tok.add_special_tokens(specials)
    if family in THINKING_FAMILIES:
        tok.add_tokens(["<think>", "</think>"])
    if "<|begin_of_text|>" in specials:
        bos = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                          special_tokens=[bos])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = dict(named, chat_template=read(template)) if with_template else dict(named)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return folder


def transformers_ids(theirs, messages, **kwargs) -> list[int]:
    out = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)   # transformers 5: a BatchEncoding


def assert_same_as_transformers(ours, theirs, messages, **kwargs):
    """Same text (the clearer failure), then the same token ids (the promise)."""
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.chat_template.render(messages, True, kwargs) == text
    assert ours.apply_chat_template(messages, **kwargs) == transformers_ids(theirs, messages, **kwargs)


def one_line_error(call) -> str:
    with pytest.raises(NanospecError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ---- the real templates of Llama 3.1, Llama 3.2, Qwen2.5 and Qwen3 ----

@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (ours, transformers'), both loaded from the same folder."""
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("chat")
    folders = {family: write_family_tokenizer(str(root / family), family) for family in FAMILIES}
    return {family: (load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))
            for family, folder in folders.items()}


CONVERSATIONS_WITH_PARTS = {**CONVERSATIONS, "text parts": PARTS,
                            "text parts, multi-turn": [SYSTEM, *PARTS, ASSISTANT, AGAIN]}
CASES = ([(family, name, {}) for family in FAMILIES for name in CONVERSATIONS]
         + [(family, name, {"enable_thinking": on}) for family in THINKING_FAMILIES
            for name in CONVERSATIONS_WITH_PARTS for on in (True, False)])


@pytest.mark.parametrize("family, conversation, kwargs", CASES,
                         ids=[f"{f}-{c}{'-' + str(k) if k else ''}" for f, c, k in CASES])
def test_family_template_gives_transformers_tokens(families, family, conversation, kwargs):
    """Text parts, to a template that reads content as text (all but GLM-4.5's, which loops over
    parts), are joined by newlines as vLLM joins them: the oracle is transformers on the joined text
    (given the list, Qwen3's template renders an empty message)."""
    ours, theirs = families[family]
    messages = CONVERSATIONS_WITH_PARTS[conversation]
    oracle = messages if family in PARTS_READ else [joined_parts(m) for m in messages]
    assert ours.chat_template.render(messages, True, kwargs) == theirs.apply_chat_template(
        oracle, tokenize=False, add_generation_prompt=True, **kwargs)
    assert_same_as_transformers(ours, theirs, oracle, **kwargs)


PARTS_READ = ("glm4.5",)   # the templates that loop over a message's parts


def joined_parts(message: dict) -> dict:
    content = message.get("content")
    return ({**message, "content": "\n".join(p["text"] for p in content)} if isinstance(content, list)
            else message)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in THINKING_FAMILIES])
def test_text_parts_are_joined_for_a_template_that_reads_content_as_text(families, family):
    """A template that does not loop over content (Llama 3, Qwen2.5: "... + message['content']")
    gets text parts joined by newlines, as vLLM joins them (transformers hands it the list, which it
    fails on or prints): the tokens are transformers' for the joined text. Qwen3's loops: it gets the
    list (test_family_template_gives_transformers_tokens)."""
    ours, theirs = families[family]
    joined = [{"role": "user", "content": "Hello \nthere"}]
    text = theirs.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert ours.chat_template.render(PARTS, True) == text


def test_llama_system_header_is_dated_today_and_bos_is_not_doubled(families):
    """Llama 3.2 dates its system header by strftime_now; the template writes BOS, and the encoding
    adds none (the tokenizer.json post-processor would)."""
    from datetime import datetime
    ours, _ = families["llama3.2"]
    ids = ours.apply_chat_template([USER])
    text = ours.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge "
                           "Date: December 2023\nToday Date: " + datetime.now().strftime("%d %b %Y"))
    assert ids.count(ours.bos_id) == 1 and ours.add_bos


def test_qwen_defaults_system_prompt_and_thinking_switch(families):
    ours, _ = families["qwen2.5"]
    assert ours.decode(ours.apply_chat_template("Hi")).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n")
    qwen3, _ = families["qwen3"]
    assert qwen3.decode(qwen3.apply_chat_template("Hi", enable_thinking=False)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.decode(qwen3.apply_chat_template("Hi")).endswith("<|im_start|>assistant\n")


# ---- SmolLM2: the GGUF file, and the folder transformers saves from it ----

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    """The GGUF tokenizer (ours and transformers'), and folders of the tokenizer transformers saved
    from it, in each place a template can be: chat_template.jinja (what save_pretrained writes),
    tokenizer_config.json's chat_template (a string, or a list of named templates), and both (the
    .jinja file wins)."""
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf),
                                           gguf_file=os.path.basename(smollm2_gguf))
    ours = from_gguf(gguf_file.metadata(gguf_file.open_reader(smollm2_gguf)))
    root = tmp_path_factory.mktemp("smollm2")
    saved = str(root / "saved")
    theirs.save_pretrained(saved)
    template = read_text(os.path.join(saved, "chat_template.jinja"))
    assert "chat_template" not in json.load(open(os.path.join(saved, "tokenizer_config.json")))
    layouts = {"chat_template.jinja": saved}
    for layout, value in (("tokenizer_config.json", template),
                          ("named templates", [{"name": "tool_use",
                                                "template": "{{ raise_exception('not me') }}"},
                                               {"name": "default", "template": template}]),
                          ("both", "{{ raise_exception('the .jinja file wins') }}")):
        folder = layouts[layout] = str(root / layout.replace(" ", "_"))
        shutil.copytree(saved, folder)
        if layout != "both":
            os.remove(os.path.join(folder, "chat_template.jinja"))
        edit_json(os.path.join(folder, "tokenizer_config.json"), chat_template=value)
    folders = {layout: (load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))
               for layout, folder in layouts.items()}
    return {"gguf": (ours, theirs), **folders}


SMOLLM2_LAYOUTS = ["gguf", "chat_template.jinja", "tokenizer_config.json", "named templates", "both"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", SMOLLM2_LAYOUTS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_smollm2_gives_transformers_tokens(smollm2, layout, conversation):
    ours, theirs = smollm2[layout]
    assert_same_as_transformers(ours, theirs, CONVERSATIONS[conversation])


@pytest.mark.parametrize("layout", SMOLLM2_LAYOUTS)
def test_smollm2_default_system_prompt_is_kept(smollm2, layout):
    """The bug this module fixed: a folder saved by a recent transformers keeps its template in
    chat_template.jinja, and without it SmolLM2's default system prompt was missing."""
    ours, _ = smollm2[layout]
    assert ours.decode(ours.apply_chat_template("Hi!")) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


# ---- no template: the family's bare format ----

def test_without_a_template_the_family_format_still_renders(checkpoints, tmp_path):
    chatml = load_tokenizer(checkpoints["qwen2"])   # its tokenizer_config.json has no chat_template
    assert chatml.decode(chatml.apply_chat_template([SYSTEM, USER])) == (
        f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n<|im_start|>user\n{USER['content']}<|im_end|>\n"
        "<|im_start|>assistant\n")
    llama = load_tokenizer(write_family_tokenizer(str(tmp_path), "llama3.1", with_template=False))
    assert llama.decode(llama.apply_chat_template("Hi ")) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_tokenizer_without_template_or_known_format_says_so():
    from nanospec.tokenizer import byte_tokenizer
    assert "no chat template" in one_line_error(lambda: byte_tokenizer().apply_chat_template("Hi"))


# ---- errors are one line ----

@pytest.mark.parametrize("messages, says", [
    (5, "non-empty list of messages"), ([], "non-empty list of messages"), (["hi"], "message 0"),
    ([{"content": "hi"}], "\"role\" string"), ([USER, {"role": "user", "content": 7}], "message 1's content"),
    ([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}], "message 0's content"),
])
def test_a_conversation_of_the_wrong_shape_is_one_line(families, messages, says):
    ours, _ = families["qwen2.5"]
    assert says in one_line_error(lambda: ours.apply_chat_template(messages))


def test_a_template_that_raises_is_one_line(tmp_path):
    """raise_exception(...) in the template (here: roles must alternate) ends in its message, as in
    transformers, where it is a jinja2 TemplateError."""
    from transformers import AutoTokenizer
    folder = write_family_tokenizer(str(tmp_path), "qwen2.5")
    edit_json(os.path.join(folder, "tokenizer_config.json"), chat_template=(
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{{ '<|im_start|>' + m.role + '\n' + m.content + "
        "'<|im_end|>\n' }}{% endfor %}"))
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert_same_as_transformers(ours, theirs, [USER, ASSISTANT, AGAIN])
    message = one_line_error(lambda: ours.apply_chat_template([USER, AGAIN]))
    assert "refused the conversation: Conversation roles must alternate" in message
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        theirs.apply_chat_template([USER, AGAIN], tokenize=False)


@pytest.mark.parametrize("template, messages, says", [
    ("{% for m in messages %}{{ m.content }}", [USER], "is not valid Jinja"),
    ("{{ messages[0].content + 1 }}", [USER], "failed on the conversation (TypeError"),
    # escaping the sandbox
    ("{{ messages.__class__ }}{{ ''.__class__.__mro__ }}", [USER], "failed on the conversation"),
])
def test_a_broken_template_is_one_line(tmp_path, template, messages, says):
    folder = write_family_tokenizer(str(tmp_path), "qwen2.5")
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)
    ours = load_tokenizer(folder)   # loading never fails on the template: plain prompts still work
    assert ours.encode("hi")
    assert says in one_line_error(lambda: ours.apply_chat_template(messages))


def test_named_templates_without_a_default_fail_only_when_chatting(tmp_path):
    folder = write_family_tokenizer(str(tmp_path), "qwen2.5")
    edit_json(os.path.join(folder, "tokenizer_config.json"),
              chat_template=[{"name": "tool_use", "template": "x"}])
    ours = load_tokenizer(folder)
    assert "none named 'default'" in one_line_error(lambda: ours.apply_chat_template("Hi"))


# ---- the front door: LLM.encode_prompt(chat=True), LLM.encode_chat, LLM.chat ----

def test_llm_chat_is_generate_on_the_rendered_prompt(tiny_llm):
    conversation = [SYSTEM, USER]
    ids = tiny_llm.encode_chat(conversation)
    assert tiny_llm.encode_prompt(USER["content"], chat=True) == tiny_llm.encode_chat([USER])
    [out] = tiny_llm.chat(conversation, greedy(8))
    [reference] = tiny_llm.generate([ids], greedy(8))
    assert out.prompt_token_ids == ids and out.token_ids == reference.token_ids
    assert out.prompt == tiny_llm.tokenizer.decode(ids)
    # a list of conversations: one output each, in order
    outs = tiny_llm.chat([[USER], conversation], greedy(8))
    assert [o.prompt_token_ids for o in outs] == [tiny_llm.encode_chat([USER]), ids]
    assert outs[1].token_ids == reference.token_ids


def test_llm_chat_errors_name_the_conversation(tiny_llm):
    assert one_line_error(
        lambda: tiny_llm.chat([[USER], [{"role": 1}]], greedy(2))).startswith("conversation 1: ")
    assert "cannot set 'messages'" in one_line_error(
        lambda: tiny_llm.chat([USER], chat_template_kwargs={"messages": []}))
    assert "chat_template_kwargs must be a dict" in one_line_error(
        lambda: tiny_llm.encode_chat([USER], chat_template_kwargs=["enable_thinking"]))


def test_llm_chat_template_kwargs_reach_the_template(checkpoints, tmp_path):
    folder = str(tmp_path / "qwen3")
    shutil.copytree(checkpoints["qwen3"], folder)
    edit_json(os.path.join(folder, "tokenizer_config.json"), chat_template=read("qwen3.jinja"))
    llm = LLM(folder, device="cpu", dtype="float32", kv_cache_gb=0.02)
    thinking_off = llm.tokenizer.decode(
        llm.encode_chat([USER], chat_template_kwargs={"enable_thinking": False}))
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    [out] = llm.chat([USER], greedy(4), chat_template_kwargs={"enable_thinking": False})
    assert out.prompt == thinking_off and len(out.token_ids) == 4
    without_prompt = llm.tokenizer.decode(llm.encode_chat([USER], add_generation_prompt=False))
    assert not without_prompt.endswith("assistant\n")
