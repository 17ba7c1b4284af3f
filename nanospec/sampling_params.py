"""SamplingParams: how a request samples and when it stops, as vLLM names them; validate() refuses
what cannot be sampled with one line that names the parameter and the fix."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from nanospec.errors import (NanospecError, check_bool, check_fields, check_int, check_real, is_int, is_real,
                             param, shown)

# Below this (and above 0) a temperature makes the float32 logits divided by it overflow: use 0, greedy.
MIN_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1
# the most likely tokens a request may ask logprobs of: vLLM's max_logprobs default, the API's top_logprobs
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0           # nucleus sampling; 1 = off
    top_k: int = 0               # 0 = off
    max_tokens: int = 64
    seed: int | None = None      # None: a random seed per request; else 0 .. 2**63 - 1
    # stop strings (one string: one stop); the text ends before the first
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # at most this K for this request (0: no speculation); None: the engine's
    num_speculative_tokens: int | None = None
    skip_special_tokens: bool = True   # the text leaves out special tokens (token_ids keep them), as in vLLM
    # the log-probability of each output token and of the N most likely (0: its own only)
    logprobs: int | None = None
    repetition_penalty: float = 1.0   # vLLM's: > 1 makes tokens of the prompt and output less likely; 1 = off
    frequency_penalty: float = 0.0    # OpenAI's: minus this x a token's count in the output; 0 = off
    presence_penalty: float = 0.0     # OpenAI's: minus this for a token in the output; 0 = off
    # vLLM's: drop tokens less likely than min_p x the most likely's probability
    min_p: float = 0.0
    # tokens that end it as EOS does (kept in token_ids)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False   # the text keeps the stop string or stop token that ended it

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def processed(self) -> bool:
        """Whether its logits take penalties or min_p before sampling (logits_processors.py; greedy
        keeps the argmax whatever min_p drops)."""
        return self.penalized or (self.min_p > 0 and self.temperature > 0)

    def validate(self) -> None:
        """Refuse what cannot be sampled, naming the parameter; a single stop string becomes a list of one."""
        temperature = param("temperature")
        check_real(self.temperature, temperature, low=0, fix="0 is greedy")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise NanospecError(f"{temperature} {self.temperature} is too small to sample with (the logits "
                                f"divided by it overflow); use 0 for greedy, or at least {MIN_TEMPERATURE}")
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            raise NanospecError(f"{param('top_p')} must be in (0, 1] (1 is off), got {shown(self.top_p)}")
        check_int(self.max_tokens, param("max_tokens", "--max-new-tokens"), low=1)
        check_fields(self, {"top_k": partial(check_int, low=0, high=2**63 - 1, fix="0 is off"),
                            "seed": partial(check_int, low=0, high=MAX_SEED), "ignore_eos": check_bool,
                            "skip_special_tokens": check_bool, "include_stop_str_in_output": check_bool,
                            "num_speculative_tokens": partial(check_int, low=0,
                                                              fix="0 turns speculation off"),
                            "logprobs": partial(check_int, low=0, high=MAX_LOGPROBS),
                            # (bounded: a logit / 1e-40 overflows float32, and the step would blame the model)
                            "repetition_penalty": partial(check_real, low=0.01, high=100, fix="1 is off"),
                            "frequency_penalty": partial(check_real, low=-2, high=2, fix="0 is off"),
                            "presence_penalty": partial(check_real, low=-2, high=2, fix="0 is off"),
                            "min_p": partial(check_real, low=0, high=1, fix="0 is off")})
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise NanospecError(f"{param('stop_token_ids')} must be a list of token ids, got "
                                f"{shown(self.stop_token_ids)}")
        for token in self.stop_token_ids:
            if not (is_int(token) and token >= 0):
                raise NanospecError(f"{param('stop_token_ids')} must hold token ids (integers >= 0), got "
                                    f"{shown(token)}")
        self.stop = stop_strings(self.stop)


def stop_strings(stop) -> list[str]:
    """A list of non-empty strings; one string is one stop (not its characters)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, (list, tuple)) and all(isinstance(s, str) for s in stops)):
        raise NanospecError(f"{param('stop')} must be a string or a list of strings, got {shown(stop)}")
    if "" in stops:
        raise NanospecError(f"{param('stop')} holds an empty string, which would stop before any text; "
                            "remove it")
    for s in stops:   # (JSON may hold lone surrogates: no text decodes to them, and the stop check encodes)
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise NanospecError(f"{param('stop')} holds {ascii(s)}, which is not valid text (a lone UTF-16 "
                                "surrogate); remove it") from None
    return list(stops)
