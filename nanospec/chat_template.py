"""The chat template: the checkpoint's own Jinja program that turns a conversation (a list of
{"role", "content"} messages) into the prompt text the model was trained on.

It is found where transformers finds it, in the same order: `chat_template.jinja` in the folder
(what a recent transformers' save_pretrained writes), else the `chat_template` of
tokenizer_config.json (a string, or a list of {"name", "template"} of which "default" is used),
else the GGUF metadata's `tokenizer.chat_template`. It is rendered as transformers renders it
(transformers/utils/chat_template_utils.py: `_compile_jinja_template`, `render_jinja_template`):
a sandboxed Jinja environment with trim_blocks, lstrip_blocks and loop controls; a `tojson` that
does not escape HTML; the globals raise_exception and strftime_now; the variables messages,
add_generation_prompt, tools, documents, the tokenizer's named special tokens (bos_token,
eos_token, ...) and any extra keyword arguments (Qwen3's enable_thinking).

The invariant: for the same messages and arguments the rendered text is transformers' text, so its
tokens (encoded without adding a BOS again, special tokens parsed) are apply_chat_template's. Only a
checkpoint that carries no template at all gets the bare Llama 3 or ChatML format its special
tokens name. A conversation of the wrong shape, or one the template refuses (raise_exception), is
one NanospecError line, never a Jinja traceback.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanospec.errors import NanospecError, shown

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# set by the caller's parameters, not by keyword arguments
RENDER_ARGUMENTS = ("messages", "add_generation_prompt")
# transformers fills the first two from any of them
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MESSAGES_FIX = 'give a list of {"role": "user", "content": "..."} messages'

# Only for a checkpoint without any template: the bare format of the family its special tokens name.
TEXT = "(m.content if m.content is string else m.content | map(attribute='text') | join)"
FALLBACKS = {
    "<|start_header_id|>": ("<|begin_of_text|>{% for m in messages %}"
                            "<|start_header_id|>{{ m.role }}<|end_header_id|>"
                            "\n\n{{ " + TEXT + " | trim }}<|eot_id|>{% endfor %}"
                            "{% if add_generation_prompt %}"
                            "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "<|im_start|>": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ " + TEXT + " }}<|im_end|>\n"
                     "{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
}


class TemplateRefused(jinja2.TemplateError):
    """What the template's raise_exception(message) raises: it refuses this conversation."""


@dataclass
class ChatTemplate:
    source: str | None          # the Jinja program (None with `problem`)
    where: str                  # where it was found, for messages
    # bos_token, eos_token, ...: variables it may read
    special_tokens: dict[str, str] = field(default_factory=dict)
    problem: str | None = None  # why the checkpoint's template cannot be used, said when a chat is rendered

    def render(self, messages, add_generation_prompt: bool = True,
               template_kwargs: dict | None = None) -> str:
        if self.problem:
            raise NanospecError(self.problem)
        template = compile_template(self.source, self.where)
        messages = check_messages(messages, parts=reads_content_parts(template, self.source))
        variables = {"tools": None, "documents": None, **self.special_tokens,
                     **check_template_kwargs(template_kwargs),
                     "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(**variables)
        except TemplateRefused as e:
            raise NanospecError(f"the chat template ({self.where}) refused the conversation: {one_line(e)}; "
                                "give messages in the order and roles this model's template "
                                "expects") from None
        except Exception as e:   # the template's own code failed on them (TypeError, UndefinedError, ...)
            raise NanospecError(f"the chat template ({self.where}) failed on the conversation "
                                f"({type(e).__name__}: {one_line(e)}); give messages of the shape this "
                                "model's template expects") from None


def load_template(folder: str | None = None, config: dict | None = None, gguf_metadata: dict | None = None,
                  special_tokens: dict[str, str] | None = None, vocab_specials=()) -> ChatTemplate | None:
    """The checkpoint's template, else the fallback format its special tokens name, else None."""
    special_tokens = special_tokens or {}
    if folder and os.path.isfile(path := os.path.join(folder, TEMPLATE_FILE)):
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), path, special_tokens)
        except (OSError, UnicodeDecodeError) as e:
            raise NanospecError(f"cannot read {path} ({e}); re-download the checkpoint") from e
    if config and config.get("chat_template") is not None:
        where = os.path.join(folder or ".", "tokenizer_config.json") + " chat_template"
        return from_config_value(config["chat_template"], where, special_tokens)
    if gguf_metadata and gguf_metadata.get("tokenizer.chat_template") is not None:
        return from_config_value(gguf_metadata["tokenizer.chat_template"], "the GGUF tokenizer.chat_template",
                                 special_tokens)
    fallback = next((source for marker, source in FALLBACKS.items() if marker in vocab_specials), None)
    if not fallback:
        return None
    return ChatTemplate(fallback, "the built-in format; the checkpoint has no chat template", special_tokens)


def from_config_value(value, where: str, special_tokens: dict[str, str]) -> ChatTemplate:
    """A template string, or transformers' list of named templates (the one named "default")."""
    if isinstance(value, list) and all(isinstance(t, dict) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        if "default" not in named:
            return ChatTemplate(None, where, special_tokens,
                                f"{where} holds templates named {sorted(map(str, named))} but none named "
                                "'default'; add one named 'default' (or a chat_template.jinja)")
        value, where = named["default"], where + " 'default'"
    if not isinstance(value, str):
        return ChatTemplate(None, where, special_tokens, f"{where} is {str(value)[:60]!r}, not a Jinja "
                            "template string; re-download the tokenizer files")
    return ChatTemplate(value, where, special_tokens)


def named_special_tokens(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as tokenizer_config.json names them (a string, or an AddedToken object)."""
    values = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
    values = {name: v.get("content") if isinstance(v, dict) else v for name, v in values.items()}
    return {name: value for name, value in values.items() if isinstance(value, str)}


def check_messages(messages, parts: bool = True) -> list[dict]:
    """The conversation as transformers hands it to the template: keys whose value is None dropped
    (a missing key renders as a template expects, a None as the text "None"), reasoning aliased.
    parts False (a template that reads content as text): text parts joined by newlines, as vLLM
    joins them for such a template (transformers hands it the list, which it fails on or prints)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise NanospecError(f"a conversation must be a non-empty list of messages, got {shown(messages)}; "
                            f"{MESSAGES_FIX}")
    checked = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise NanospecError(f"message {i} must be a dict with a \"role\" string, got {shown(message)}; "
                                f"{MESSAGES_FIX}")
        content = message.get("content")
        if not (content is None or isinstance(content, str) or is_text_parts(content)):
            raise NanospecError(f"message {i}'s content must be a string, null or a list of {{\"type\": "
                                f"\"text\", \"text\": \"...\"}} parts, got {shown(content)}; {MESSAGES_FIX}")
        message = {key: value for key, value in message.items() if value is not None}
        if not parts and is_text_parts(content):
            message["content"] = "\n".join(part["text"] for part in content)
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        checked.append(message)
    return checked


@functools.lru_cache(maxsize=32)
def reads_content_parts(template: jinja2.Template, source: str) -> bool:
    """Whether the template loops over a message's content (`for part in message.content`, or
    message['content'], through filters): it takes OpenAI's list of parts. vLLM's test for its
    "openai" content format; other templates read content as text."""
    for loop in template.environment.parse(source).find_all(jinja2.nodes.For):
        over = loop.iter
        while isinstance(over, jinja2.nodes.Filter):
            over = over.node
        if (isinstance(over, jinja2.nodes.Getattr) and over.attr == "content") or (
                isinstance(over, jinja2.nodes.Getitem) and isinstance(over.arg, jinja2.nodes.Const)
                and over.arg.value == "content"):
            return True
    return False


def is_text_parts(content) -> bool:
    return isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                             and isinstance(part.get("text"), str) for part in content)


def check_template_kwargs(kwargs) -> dict:
    """Extra variables for the template (enable_thinking=False, tools=[...], date_string=...)."""
    if kwargs is None:
        return {}
    if not (isinstance(kwargs, dict) and all(isinstance(key, str) for key in kwargs)):
        raise NanospecError(f"chat_template_kwargs must be a dict of names to values, got {shown(kwargs)}")
    taken = [key for key in kwargs if key in RENDER_ARGUMENTS]
    if taken:
        raise NanospecError(f"chat_template_kwargs cannot set {taken[0]!r}; pass it as its own parameter")
    return kwargs


@functools.lru_cache(maxsize=32)
def compile_template(source: str, where: str) -> jinja2.Template:
    """transformers' environment (its AssistantTracker's `{% generation %}` tag renders its body here)."""
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise NanospecError(f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox escapes), found "
                            f"{jinja2.__version__}; run `pip install -U jinja2`")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise NanospecError(f"the chat template ({where}) is not valid Jinja: {one_line(e)} (line "
                            f"{e.lineno}); fix or replace the template") from None


def raise_exception(message):
    raise TemplateRefused(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Jinja's own tojson escapes HTML characters; templates expect plain JSON."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens in training templates."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("body"), [], [], body).set_lineno(lineno)

    def body(self, caller):
        return caller()


class TemplateDict:
    """dict() for templates without the class itself (no attribute access to type internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """namespace() whose attributes cannot start with an underscore (no reach into Python internals)."""

    def __init__(*args, **kwargs):   # Jinja's signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the attribute {name!r} on a namespace")


def one_line(error) -> str:
    return " ".join(str(getattr(error, "message", None) or error).split())
