"""nanospec: a compact, readable PyTorch inference engine for speculative decoding."""
from nanospec.request import RequestOutput
from nanospec.sampling_params import SamplingParams
from nanospec.errors import NanospecError
from nanospec.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "NanospecError"]
