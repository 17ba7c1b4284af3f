"""The front door: `LLM(target).generate(prompts, SamplingParams(...))`.

Loads the checkpoint and its tokenizer (and the proposer: a draft model, an EAGLE head or n-gram
lookup), picks device and dtype, sizes the paged KV cache and runs the engine until every request
is done.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from functools import partial

import torch

from nanospec import checkpoint
from nanospec.chat_template import check_template_kwargs
from nanospec.cuda_graph import StepOptions
from nanospec.dynamic_k import DynamicK, Profile, device_name, quick_profile, step_memory
from nanospec.eagle import load_eagle_head
from nanospec.engine import Engine
from nanospec.request import RequestOutput, emittable_vocab
from nanospec.sampling_params import SamplingParams
from nanospec.stats import Stats
from nanospec.errors import (COMMAND_LINE, NanospecError, check_bool, check_fields, check_int, check_real,
                             param)
from nanospec.k_policy import KPolicy, QueueSwitch, StaticK
from nanospec.prompts import shipped_prompts
from nanospec.hybrid import HybridProposer
from nanospec.proposer import DraftModelProposer, EagleProposer, NgramProposer, Proposer
from nanospec.suffix import LLM_SETTINGS, SuffixProposer
from nanospec.tokenizer import load_tokenizer
from nanospec.tree import MAX_NODES, parse_static_tree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    device = str(device) if isinstance(device, torch.device) else device
    if not isinstance(device, str):
        raise NanospecError(f"{param('device')} must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NanospecError("--device cuda was asked for but no CUDA GPU is visible; "
                            "use --device cpu or auto")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise NanospecError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise NanospecError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DYNAMIC_MAX_K = 8     # the largest K dynamic K may choose, unless told
DEFAULT_TREE_STEPS = 4        # an EAGLE-2 tree's depth, unless told (speculative_num_steps)


def kv_block_bytes(config, dtype: torch.dtype, block_size: int, num_layers: int | None = None) -> int:
    layers = num_layers or config.num_layers
    return 2 * layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def check_path(value, name: str) -> None:
    if not isinstance(value, (str, os.PathLike)):
        raise NanospecError(f"{name} must be a path (a string), got {value!r}")


@dataclass(slots=True)
class SpeculativeConfig:
    """Which proposer drafts, and how many drafts a step verifies; validate() checks the whole and
    returns K (messages name Python parameters to library callers, flags on the command line). The
    fields are LLM's keyword arguments and the command line's flags, by the same names."""
    draft: str | None = None                # a draft model (folder, hub id or .gguf)
    eagle: str | None = None                # an EAGLE-1 / EAGLE-3 head: a folder or a hub id
    # the ids an EAGLE-1 head drafts among (SGLang's FR-Spec token map: a torch.save'd list), or all
    speculative_token_map: str | None = None
    ngram: bool = False                     # prompt lookup
    num_speculative_tokens: int | None = None   # K (default 4; dynamic K's largest, 8; suffix: 16)
    dynamic_k: bool = False
    profile: str | None = None              # dynamic K's step-time table (default: measured at start-up)
    per_request_k: bool = False             # dynamic K: a K per request
    speculative_disable_queue_size: int | None = None   # no speculation while more than this wait or run
    ngram_min: int = 1
    ngram_max: int = 4
    suffix: bool = False                    # suffix decoding; with draft or eagle, the hybrid of both
    suffix_max_spec_offset: int | None = None   # drafts at most L + this after a match of L (default 3)
    # vLLM's suffix_decoding_* settings: requests the global index holds (0: none, only each request's
    # own), drafts at most L * factor (+ the offset) after a match of L, a draft stops below this probability
    suffix_max_cached_requests: int | None = None   # default 10,000
    suffix_max_spec_factor: float | None = None     # default 1.0
    suffix_min_token_prob: float | None = None      # default 0.1
    # the most children a draft node has: 1 drafts chains, more trees of K nodes (SGLang's
    # speculative_eagle_topk): suffix decoding's, or EAGLE-2's from a head or a draft model
    speculative_topk: int = 1
    speculative_num_steps: int | None = None   # an EAGLE-2 tree's depth: its drafter's steps (default 4)
    # a static tree, vLLM's speculative_token_tree: "[(0,), (1,), (0, 0)]", each node its path of child
    # ranks (suffix decoding's drafts for now); K is its number of nodes
    speculative_token_tree: str | None = None

    def static_tree(self) -> list[int] | None:
        """The static tree's parent list (tree.parse_static_tree), or None."""
        if self.speculative_token_tree is None:
            return None
        try:
            return parse_static_tree(self.speculative_token_tree)
        except ValueError as e:
            raise NanospecError(f"{param('speculative_token_tree')}: {e}") from None

    def suffix_settings(self) -> dict:
        """SuffixProposer's keyword arguments for the settings given."""
        return {arg: getattr(self, name) for name, arg in LLM_SETTINGS.items()
                if getattr(self, name) is not None}

    @property
    def hybrid(self) -> bool:
        return self.suffix and bool(self.draft or self.eagle)

    @property
    def proposer_name(self) -> str | None:
        model = f"draft {self.draft}" if self.draft else f"eagle {self.eagle}" if self.eagle else None
        if self.suffix:
            return f"hybrid: suffix + {model}" if model else "suffix"
        return "ngram" if self.ngram else model

    @property
    def default_k(self) -> int:
        """K when none is given: suffix decoding's ceiling, as it drafts as far as its match is strong
        (vLLM's default too: the tree depth; under dynamic K its largest, and the hybrid's plans'
        ceiling); dynamic K's largest for the others; else 4."""
        if self.suffix:
            return MAX_SPECULATIVE_TOKENS
        return DEFAULT_DYNAMIC_MAX_K if self.dynamic_k else 4

    def validate(self) -> int:
        """K for the chosen proposer, or 0 without one. Each field alone first (a suffix setting without
        suffix is told so before its bounds are checked), then how the fields combine."""
        check_fields(self, {"draft": check_path, "eagle": check_path, "profile": check_path,
                            "speculative_token_map": check_path,
                            "ngram": check_bool, "suffix": check_bool, "dynamic_k": check_bool,
                            "per_request_k": check_bool, "ngram_min": partial(check_int, low=1),
                            "ngram_max": partial(check_int, low=self.ngram_min,
                                                 fix=f"it is at least {param('ngram_min')}"),
                            "speculative_disable_queue_size": partial(check_int, low=0)})
        for name in LLM_SETTINGS:
            if getattr(self, name) is not None and not self.suffix:
                raise NanospecError(f"{param(name)} is a setting of suffix decoding: add {param('suffix')}")
        check_fields(self, {"suffix_max_spec_offset": partial(check_int, low=0, high=MAX_SPECULATIVE_TOKENS),
                            "suffix_max_cached_requests": partial(check_int, low=0),
                            # (a match of 1 at factor 16 reaches the largest K)
                            "suffix_max_spec_factor": partial(check_real, low=0, high=MAX_SPECULATIVE_TOKENS),
                            "suffix_min_token_prob": partial(check_real, low=0, high=1)})
        chosen = self.chosen_proposer()
        if self.speculative_token_map is not None and not self.eagle:
            raise NanospecError(f"{param('speculative_token_map')} is the vocabulary an EAGLE-1 head drafts "
                                f"among: add {param('eagle')}")
        self.check_dynamic_k_settings()
        self.check_tree_settings(chosen)
        k_name = param("num_speculative_tokens")
        if not chosen:
            for name, on in ((k_name, self.num_speculative_tokens is not None),
                             (param("dynamic_k"), self.dynamic_k),
                             (param("speculative_disable_queue_size"),
                              self.speculative_disable_queue_size is not None)):
                if on:
                    raise NanospecError(f"{name} needs a proposer: set {param('draft')}, {param('eagle')}, "
                                        f"{param('ngram')} or {param('suffix')}")
            return 0
        k = self.default_k if self.num_speculative_tokens is None else self.num_speculative_tokens
        static = self.static_tree()
        if static and self.num_speculative_tokens not in (None, len(static) - 1):
            raise NanospecError(f"{k_name} {k} differs from the {len(static) - 1} nodes of "
                                f"{param('speculative_token_tree')}: leave it unset, or give the tree's size")
        most = MAX_NODES if static or self.speculative_topk > 1 else MAX_SPECULATIVE_TOKENS   # a tree's nodes
        return check_int(len(static) - 1 if static else k, k_name, low=1, high=most)

    def check_tree_settings(self, chosen: list[str]) -> None:
        """Trees: grown (speculative_topk > 1) by suffix decoding, an EAGLE head or a draft model; static
        by suffix decoding; not by the hybrid or n-gram; one kind at a time; a static tree fixes K (not
        with dynamic K)."""
        topk, static, steps = (param(n) for n in ("speculative_topk", "speculative_token_tree",
                                                  "speculative_num_steps"))
        check_int(self.speculative_topk, topk, low=1, high=MAX_SPECULATIVE_TOKENS)
        shape = self.static_tree()
        asked = f"{topk} {self.speculative_topk}" if self.speculative_topk > 1 else static
        if (self.speculative_topk > 1 and (self.hybrid or chosen not in (["suffix"], ["eagle"], ["draft"]))
                or shape and chosen != ["suffix"]):
            drafters = "suffix decoding" if shape else "suffix decoding, an EAGLE head or a draft model"
            raise NanospecError(f"{asked} drafts trees, which {drafters} draft (not the hybrid or n-gram): "
                                f"choose one of them, or leave it out")
        if self.speculative_num_steps is not None:
            if self.speculative_topk == 1 or chosen == ["suffix"]:
                raise NanospecError(f"{steps} is the depth of an EAGLE head's or a draft model's tree: add "
                                    f"{topk} N (N > 1) with {param('eagle')} or {param('draft')}")
            check_int(self.speculative_num_steps, steps, low=1, high=MAX_SPECULATIVE_TOKENS)
        if shape and self.speculative_topk > 1:
            raise NanospecError(f"choose one kind of tree: {topk} (grown by probability) or {static} (fixed)")
        if shape and self.dynamic_k:
            raise NanospecError(f"{static} fixes the drafts a step verifies: drop {param('dynamic_k')}")

    def chosen_proposer(self) -> list[str]:
        """The one proposer asked for (suffix with a model: the model's name), or none."""
        chosen = [name for name in ("draft", "eagle", "ngram") if getattr(self, name)]
        if len(chosen) > 1 or (self.suffix and self.ngram):
            both = chosen + ["suffix"] * self.suffix
            raise NanospecError(f"choose one proposer, got {' and '.join(map(param, both))}: use "
                                f"{param('draft')}, {param('eagle')}, {param('ngram')} or {param('suffix')} "
                                f"alone (or {param('suffix')} with {param('draft')} or {param('eagle')}: "
                                "the hybrid)")
        return chosen + ["suffix"] * (self.suffix and not chosen)

    def check_dynamic_k_settings(self) -> None:
        for name in ("profile", "per_request_k"):
            if getattr(self, name) and not self.dynamic_k:
                raise NanospecError(f"{param(name)} is a setting of dynamic K: add {param('dynamic_k')}")
            if getattr(self, name) and self.hybrid:
                raise NanospecError(f"{param(name)} is not for the hybrid: under {param('dynamic_k')} it "
                                    "prices its plans per step and request by the step times it measures "
                                    "(hybrid.py)")


@dataclass(slots=True)
class EngineSizes:
    """The KV pool and the scheduler's limits; validate() checks them before anything loads."""
    max_model_len: int | None = None   # the longest prompt + output (default: the model's positions, or
    #                                    what the KV cache holds if less)
    kv_cache_gb: float | None = None   # the KV pool's memory (default: 1 GiB on CPU, 0.8 of free GPU memory)
    num_kv_blocks: int | None = None   # an exact pool size, in blocks (wins over kv_cache_gb)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024

    def validate(self) -> None:
        check_fields(self, {
            "max_model_len": partial(check_int, low=2, fix="it is the longest prompt + output"),
            "kv_cache_gb": partial(check_real, above=0),
            "num_kv_blocks": partial(check_int, low=1,
                                     fix="or leave it unset to size the pool by " + param("kv_cache_gb")),
            "block_size": partial(check_int, low=1, high=1024),
            "max_num_seqs": partial(check_int, low=1),
            "max_num_batched_tokens": partial(check_int, low=1)})

    def pool_blocks(self, budget_gb: float | None, block_bytes: int) -> int:
        """The pool's blocks: num_kv_blocks when given (an exact count wins), else as many blocks of
        `block_bytes` as `budget_gb` holds, at least one."""
        return self.num_kv_blocks or max(1, int(budget_gb * 2**30 // block_bytes))


@dataclass(slots=True)
class EngineOptions:
    """How the engine runs its steps and where a request's sampling defaults come from; validate()
    checks them before anything loads. compile_sampler: torch.compile the sampler (default: on CUDA).
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying CUDA graphs (the same step,
    on the same buffers). enable_prefix_caching: reuse the K/V of a prompt's leading blocks that an
    earlier request computed, the target's and a model proposer's (kv_cache.py; default: on, as in
    vLLM). generation_config: "auto", the sampling defaults of a request that does not set its own
    are those of the checkpoint's generation_config.json (vLLM's default; `sampling_defaults`), or
    "vllm", the neutral ones. step_options: how eager steps run and the CPU's attention
    (cuda_graph.StepOptions: padded as graphs are, rehearsed, the K/V mirror; None: its defaults)."""
    compile_sampler: bool | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool | None = None
    generation_config: str = "auto"
    step_options: StepOptions | None = None

    @property
    def steps(self) -> StepOptions:
        return self.step_options or StepOptions()

    def validate(self) -> None:
        check_fields(self, {"compile_sampler": check_bool, "enforce_eager": check_bool})
        if not isinstance(self.step_options, (StepOptions, type(None))):
            raise NanospecError(f"step_options must be a nanospec.cuda_graph.StepOptions or None, got "
                                f"{self.step_options!r}")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise NanospecError(f"{param('enable_prefix_caching')} must be True, False or None "
                                f"(the default: on), got {self.enable_prefix_caching!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise NanospecError(f"{param('generation_config')} must be auto (the checkpoint's "
                                "generation_config.json sets the sampling defaults) or vllm (the neutral "
                                f"ones), got {self.generation_config!r}")


@dataclass(slots=True)
class DraftModels:
    """The proposer's models, loaded once: every engine built (those that measure, the one that runs)
    gets proposers over them."""
    draft: torch.nn.Module | None = None        # a draft model
    head: torch.nn.Module | None = None         # an EAGLE head
    aux_layers: list[int] | None = None         # the target layers whose hidden states the head reads


def check_target(target) -> None:
    if target is not None and not isinstance(target, (str, os.PathLike)):
        raise NanospecError(f"{param('target')} must be a path or a hub id (a string), got {target!r}")


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft: str) -> None:
    if (target_tokenizer.id_to_bytes != draft_tokenizer.id_to_bytes
            or target_tokenizer.special_tokens != draft_tokenizer.special_tokens):
        raise NanospecError(f"draft model {draft} has a different vocabulary from the target (its tokenizer "
                            "maps ids to other tokens); use a draft of the same model family and tokenizer")


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on the device (CPU: the kernel's MemAvailable, and within
    a container's cgroup limit)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:   # cgroup v2: a container may hold less than the machine has free
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit, used = f.read().strip(), int(g.read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


# generation_config.json's sampling fields that a request without its own takes, as vLLM takes them
# (--generation-config auto, its default; all that vLLM takes): the request's value, else the
# file's, else the neutral one. By SamplingParams' names (the file's max_new_tokens is max_tokens).
# do_sample is not read, as vLLM does not read it.
SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty",
                     "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


def sampling_defaults(generation: dict, source: str) -> tuple[dict, list[str]]:
    """(the SamplingParams fields a checkpoint's generation_config sets, checked; those settings as
    the file names them, "key=value")."""
    given = {key: generation[key] for key in SAMPLING_DEFAULTS if generation.get(key) is not None}
    defaults = {SAMPLING_DEFAULTS[key]: value for key, value in given.items()}
    if defaults.get("top_k") == -1:
        defaults["top_k"] = 0   # -1 is "off" in vLLM, 0 in nanospec
    fix = f"fix the file, or ask for the neutral defaults with {param('generation_config')} vllm"
    by_python_name = COMMAND_LINE.set(False)   # the message names the file's keys, not the command's flags
    try:
        if "max_new_tokens" in given:   # (SamplingParams would call it max_tokens)
            check_int(given["max_new_tokens"], "max_new_tokens", low=1)
        SamplingParams(**defaults).validate()
    except NanospecError as e:
        raise NanospecError(f"{source}: {e}; {fix}") from None
    finally:
        COMMAND_LINE.reset(by_python_name)
    return defaults, [f"{key}={value}" for key, value in given.items()]


def settings_records(settings: dict) -> tuple[EngineOptions, EngineSizes, SpeculativeConfig]:
    """LLM's keyword arguments as the records whose fields they are (a field left out keeps its
    default there); a keyword that no record has is refused as Python refuses it."""
    kinds = (EngineOptions, EngineSizes, SpeculativeConfig)
    names = [{field.name for field in dataclasses.fields(kind)} for kind in kinds]
    unknown = [key for key in settings if not any(key in fields for fields in names)]
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    return tuple(kind(**{key: value for key, value in settings.items() if key in fields})
                 for kind, fields in zip(kinds, names))


class LLM:
    def __init__(self, target: str | None = None, device: str = "auto", dtype: str = "auto", *, log=None,
                 **settings):
        """Load the target, its tokenizer and proposer, and build an engine sized for them. The other
        keyword arguments are the fields of three records, by the same names and defaults, each checked
        before anything loads: EngineOptions (how steps run), EngineSizes (the KV pool and the
        scheduler's limits) and SpeculativeConfig (the proposer and K). log: a callable given a line
        about long work (the quick dynamic-K profile), or None."""
        self.options, self.sizes, self.spec = settings_records(settings)
        self.log = log or (lambda line: None)
        check_target(target)
        self.options.validate()
        self.sizes.validate()
        k = self.spec.validate()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.proposer_name = self.spec.proposer_name
        reachable = self.load_target(target)
        self.draft_models = self.load_draft_models(reachable)
        num_blocks = self.size_kv_pool(k)
        policy = self.k_policy(k)
        # the hybrid under dynamic K: K its ceiling, and each step's plan priced by the hybrid itself
        self.engine = self.make_engine(num_blocks, policy, priced=self.spec.dynamic_k)
        self.engine.max_k = k   # a request may ask for less (SamplingParams.num_speculative_tokens), not more
        self.engine.step_graphs.capture_all(range(k + 1))   # CUDA graphs of every K the policy can choose

    def load_target(self, target: str | None) -> int:
        """The target model, its tokenizer and the checkpoint's sampling defaults. Returns the positions
        a request can reach: no request outlives the KV pool, so no model needs position tables past
        it (a config may claim billions of positions); measured before the weights load, the budget
        bounds the pool."""
        ckpt = checkpoint.read_checkpoint(target)
        self.target_name = target or checkpoint.DEFAULT_MODEL_FILE
        self.config = ckpt.config
        generation = ckpt.generation if self.options.generation_config == "auto" else {}
        self.sampling_defaults, self.sampling_defaults_read = sampling_defaults(
            generation, os.path.join(ckpt.path, "generation_config.json"))
        self.max_model_len = self.context_length()
        sizes = self.sizes
        target_block = kv_block_bytes(self.config, self.dtype, sizes.block_size)
        pool_tokens = sizes.block_size * sizes.pool_blocks(sizes.kv_cache_gb or self.default_kv_cache_gb(),
                                                           target_block)
        reachable = min(self.max_model_len, pool_tokens)
        self.model = checkpoint.build_model(ckpt, self.device, self.dtype, reachable)
        self.tokenizer = load_tokenizer(ckpt.path, ckpt.gguf_metadata)
        self.vocab_size = emittable_vocab(self.config, self.tokenizer)   # the ids a request may hold
        return reachable

    def context_length(self) -> int:
        """max_model_len as asked, within the model's positions; by default the positions (size_kv_pool
        lowers it to what the KV cache holds, if less)."""
        asked, positions = self.sizes.max_model_len, self.config.max_position_embeddings
        if asked is not None and asked > positions:
            raise NanospecError(f"{param('max_model_len')} {asked} is above the {positions} positions the "
                                f"model has (max_position_embeddings); lower it")
        return asked or positions

    def load_draft_models(self, max_len: int) -> DraftModels:
        spec = self.spec
        if (spec.draft or spec.eagle) and spec.speculative_topk > self.vocab_size:   # top-k of the ids
            raise NanospecError(f"{param('speculative_topk')} {spec.speculative_topk} is more than the "
                                f"{self.vocab_size} tokens the target can emit: give at most that")
        draft = self.load_draft(spec.draft, max_len) if spec.draft else None
        head, aux_layers = load_eagle_head(spec.eagle, self.model, self.device, self.dtype,
                                           spec.speculative_token_map) if spec.eagle else (None, None)
        return DraftModels(draft, head, aux_layers)

    @property
    def use_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: on CUDA, unless enforce_eager."""
        return self.device.type == "cuda" and not self.options.enforce_eager

    def make_proposer(self, blocks: int, priced: bool = False) -> Proposer | None:
        """The proposer asked for, over the loaded draft models, with `blocks` KV blocks for a model's
        cache; priced: the hybrid prices each step's plan by the step times it measures."""
        spec, models, block_size = self.spec, self.draft_models, self.sizes.block_size
        if spec.ngram:
            return NgramProposer(self.device, spec.ngram_min, spec.ngram_max)
        model_drafter = None
        if models.draft is not None:
            model_drafter = DraftModelProposer(models.draft, blocks, block_size, self.vocab_size, self.device)
        if models.head is not None:
            model_drafter = EagleProposer(models.head, self.model, models.aux_layers, blocks, block_size,
                                          self.vocab_size, self.device)
        if model_drafter is not None and spec.speculative_topk > 1:   # EAGLE-2 trees
            model_drafter.tree = spec.speculative_topk, spec.speculative_num_steps or DEFAULT_TREE_STEPS
            model_drafter.max_slots = self.max_model_len
        if not spec.suffix:
            return model_drafter
        suffix_proposer = SuffixProposer(self.device, branches=spec.speculative_topk,
                                         shape=spec.static_tree(), **spec.suffix_settings())
        if model_drafter is None:
            return suffix_proposer
        return HybridProposer(suffix_proposer, model_drafter, priced=priced)

    def make_engine(self, blocks: int, policy: KPolicy, priced: bool = False) -> Engine:
        """An engine of `blocks` KV blocks (the target's and its proposer's each) under `policy`."""
        sizes, options = self.sizes, self.options
        return Engine(self.model, self.tokenizer, self.device, self.max_model_len, blocks, sizes.block_size,
                      sizes.max_num_seqs, sizes.max_num_batched_tokens, options.compile_sampler,
                      self.make_proposer(blocks, priced), policy, use_graphs=self.use_graphs,
                      prefix_caching=options.enable_prefix_caching is not False, step_options=options.steps)

    def block_bytes(self) -> int:
        """One block's bytes in every KV pool: the target's, and the draft model's or the EAGLE head's
        (one layer)."""
        block_size, models = self.sizes.block_size, self.draft_models
        total = kv_block_bytes(self.config, self.dtype, block_size)
        if models.draft is not None:
            total += kv_block_bytes(models.draft.config, self.dtype, block_size)
        if models.head is not None:
            total += kv_block_bytes(models.head.config, self.dtype, block_size, num_layers=1)
        return total

    def size_kv_pool(self, k: int) -> int:
        """The KV pool's blocks: target and proposer get the same number (see proposer.py), from one
        memory budget. By default the context is what the pool holds, if less than the model's
        positions: else a request asking for the whole context (a chat's default max_tokens) would
        be refused."""
        sizes = self.sizes
        budget_gb = sizes.kv_cache_gb
        if budget_gb is None and sizes.num_kv_blocks is None:   # on a GPU: a share of what is left free
            graphs = step_memory(self.make_engine(1, StaticK(0)), k) if self.use_graphs else 0
            budget_gb = self.default_kv_cache_gb(graphs)
        block_bytes = self.block_bytes()
        num_blocks = sizes.pool_blocks(budget_gb, block_bytes)
        self.check_pool(num_blocks, block_bytes)
        if sizes.max_model_len is None and self.max_model_len > num_blocks * sizes.block_size:
            self.max_model_len = num_blocks * sizes.block_size
            self.log(f"max_model_len: {self.max_model_len} tokens, what the KV cache holds (the model has "
                     f"{self.config.max_position_embeddings} positions; raise {param('kv_cache_gb')} "
                     "for more)")
        return num_blocks

    def k_policy(self, k: int) -> KPolicy:
        """Static K, or dynamic K by a profile of step times (the hybrid prices its own plans instead);
        either switched off past a queue size."""
        spec = self.spec
        self.profile = None           # the dynamic-K profile in use
        self.profile_seconds = None   # how long the built-in dynamic-K profile took at start-up
        policy = StaticK(k)
        if spec.dynamic_k and not spec.hybrid:
            self.profile = self.dynamic_k_profile(spec.profile, k)
            policy = DynamicK.for_proposer(self.profile, k, self.make_proposer(1),
                                           self.use_graphs or self.options.steps.pad_batches,
                                           self.sizes.max_num_seqs, per_request=spec.per_request_k)
        if spec.speculative_disable_queue_size is not None:
            policy = QueueSwitch(policy, spec.speculative_disable_queue_size)
        return policy

    def check_pool(self, num_blocks: int, block_bytes: int) -> None:
        """The KV pool fits in the device's free memory, and holds an asked-for context: refused
        here, not found by an allocation that fails (or, on CPU, by the kernel killing the process)."""
        need, free = num_blocks * block_bytes, available_memory(self.device)
        if need > free:
            raise NanospecError(f"a KV cache of {num_blocks} blocks needs {need / 2**30:.2f} GiB but "
                                f"{self.device} has {free / 2**30:.2f} GiB free; lower "
                                f"{param('kv_cache_gb')} or {param('num_kv_blocks')}")
        max_model_len, tokens = self.sizes.max_model_len, num_blocks * self.sizes.block_size
        if max_model_len is not None and max_model_len > tokens:
            raise NanospecError(f"{param('max_model_len')} {max_model_len} does not fit in the KV cache, "
                                f"which holds {tokens} tokens; lower it or raise {param('kv_cache_gb')}")

    def dynamic_k_profile(self, path: str | None, max_k: int):
        """The profile at `path`, or the quick built-in one measured now on engines built for it (from
        a one-block one)."""
        if path:
            profile = Profile.load(path)
            self.check_profile_matches(profile, path, max_k)
            return profile
        prompts = [self.encode_prompt(row["prompt"], chat=True) for row in shipped_prompts()[::4]]
        engine = self.make_engine(1, StaticK(0))
        self.log("dynamic K: measuring a quick profile of this machine (measure one once with "
                 "`python -m nanospec.profiler --out profile.json` and pass it as --profile / profile=)")
        profile = quick_profile(engine, prompts, max_k, self.profile_meta(), self.log)
        self.profile_seconds = profile.meta["seconds"]
        self.log(f"dynamic K: quick profile measured in {self.profile_seconds:.0f} s")
        return profile

    def profile_meta(self) -> dict:
        """What a profile of this LLM was measured with; a profile of another setup still runs,
        with a warning (check_profile_matches)."""
        return {"dtype": str(self.dtype), "target": self.target_name, "proposer": self.proposer_name}

    def check_profile_matches(self, profile, path: str, max_k: int) -> None:
        """A profile (at `path`) of another setup, or of fewer K than max_k, still runs, with a warning."""
        mine = {"target": self.target_name, "proposer": self.proposer_name,
                "device": device_name(self.device)}
        differ = [f"{key} {profile.meta.get(key)!r} (running {value!r})" for key, value in mine.items()
                  if profile.meta.get(key) not in (None, value)]
        if differ:
            warnings.warn("the dynamic-K profile was measured for another setup: " + ", ".join(differ)
                          + "; measure this one with `python -m nanospec.profiler`", stacklevel=3)
        if profile.max_k < max_k:   # (the profiler measures chains' K, up to 16)
            fix = (f"; measure one up to {max_k} with `python -m nanospec.profiler --max-k {max_k}`"
                   if max_k <= MAX_SPECULATIVE_TOKENS else "")
            warnings.warn(f"the dynamic-K profile {path} measured K up to {profile.max_k}, so K stays at "
                          f"most {profile.max_k} (not {max_k}){fix}", stacklevel=3)

    def load_draft(self, draft: str, max_len: int):
        ckpt = checkpoint.read_checkpoint(draft)
        check_same_tokenizer(self.tokenizer, load_tokenizer(ckpt.path, ckpt.gguf_metadata), draft)
        if ckpt.config.vocab_size < self.vocab_size:   # the target could emit an id the draft cannot embed
            raise NanospecError(f"draft model {draft} embeds {ckpt.config.vocab_size} token ids but the "
                                f"target can emit {self.vocab_size}; use a draft whose embedding covers the "
                                "tokenizer")
        return checkpoint.build_model(ckpt, self.device, self.dtype, max_len)

    def default_kv_cache_gb(self, reserve: int = 0) -> float:
        """1 GiB on CPU; on CUDA 0.8 of the free memory less `reserve` bytes (what the graphs need)."""
        if self.device.type == "cuda":
            return 0.8 * max(available_memory(self.device) - reserve, 0) / 2**30
        return 1.0

    @property
    def stats(self) -> dict:
        return self.engine.stats.as_dict()

    def encode_prompt(self, prompt: str | list[int], chat: bool = False, index: int = 0) -> list[int]:
        if isinstance(prompt, (list, tuple)):   # already token ids; the engine checks their range
            return list(prompt)
        if not isinstance(prompt, str):
            raise NanospecError(f"prompt {index} must be text or a list of token ids, got {prompt!r}")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict], chat_template_kwargs: dict | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """One conversation (a list of {"role", "content"} dicts) as prompt token ids: rendered by the
        checkpoint's chat template (chat_template_kwargs: its extra variables, e.g. enable_thinking)
        and encoded as transformers' apply_chat_template encodes it."""
        check_bool(add_generation_prompt, "add_generation_prompt")
        kwargs = check_template_kwargs(chat_template_kwargs)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             on_step=None) -> list[RequestOutput]:
        """vLLM's LLM.chat: reply to one conversation (a list of message dicts) or to each of a list
        of them. Each is rendered by the chat template and generated as generate() does with token-id
        prompts; an output's prompt is the rendered text."""
        many = (isinstance(messages, (list, tuple)) and len(messages) > 0
                and isinstance(messages[0], (list, tuple)))
        conversations = list(messages) if many else [messages]
        prompt_ids = []
        for i, conversation in enumerate(conversations):
            try:
                prompt_ids.append(self.encode_chat(conversation, chat_template_kwargs, add_generation_prompt))
            except NanospecError as e:
                raise NanospecError(f"conversation {i}: {e}" if many else str(e)) from None
        outputs = self.generate(prompt_ids, params, on_step=on_step)
        return [dataclasses.replace(out, prompt=self.tokenizer.decode(ids))
                for out, ids in zip(outputs, prompt_ids)]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's sampling defaults (generation_config), as vLLM's
        method of that name; what the file leaves out keeps nanospec's defaults (max_tokens 64)."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, on_step=None) -> list[RequestOutput]:
        """Generate for every prompt: a string, a list of token ids, or a list of either (a list of
        params gives each its own). `on_step(requests)` is called after each step with the requests
        that got new tokens (for streaming)."""
        if not isinstance(prompts, (str, list, tuple)):
            raise NanospecError("prompts must be a string, a list of token ids or a list of either, "
                                f"got {prompts!r}")
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = self.get_default_sampling_params() if params is None else params
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise NanospecError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; "
                                "give one, or one each")
        if not all(isinstance(sp, SamplingParams) for sp in per_prompt):
            raise NanospecError(f"params must be a SamplingParams or a list of them, got {params!r}")
        requests = [self.engine.new_request(i, p, self.encode_prompt(p, chat, i), sp)
                    for i, (p, sp) in enumerate(zip(prompts, per_prompt))]
        self.engine.stats = self.engine.scheduler.stats = Stats()   # llm.stats describes this call
        self.engine.add_requests(requests)  # only once every request is valid

        def after_step(updated):   # offline, one failed request (its logits not finite) ends the call
            failed = next((r for r in updated if r.error), None)
            if failed:
                raise NanospecError(failed.error)
            if on_step:
                on_step(updated)

        try:
            self.engine.run_to_completion(after_step)
        except BaseException:   # an error, or Ctrl-C: this call's requests leave with their blocks
            self.engine.abort(requests)
            raise
        return [RequestOutput(r.index, r.prompt, r.text, r.output_ids, r.finish_reason, r.prompt_ids,
                              r.logprobs) for r in requests]
