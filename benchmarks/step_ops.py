"""Counting the work a decode step launches, with the torch profiler: per step, per decoded token
and per decoder layer. What counts as one operation:

  - CUDA: each kernel, copy or memset the device runs (under a CUDA graph, each is one node).
  - CPU: each aten op that does work itself: not a view or an allocation (they move no data), and
    with no working aten op inside it (aten::linear counts once, as the addmm it calls).

Per layer: every layer's forward runs inside a profiler range (LAYER), and a layer's count is the
fewest over those ranges: a layer's own work, without what the first layer of a pass builds for the
others (the mask, the rotary tables; the layers are alike otherwise). Everything else in the step
(that, the embedding, the final norm, lm_head, sampling, the proposer) is `outside_layers`. Decoded
tokens are what the requests gained in the counted steps.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

LAYER = "nanospec::decoder_layer"
NO_WORK = {   # aten ops that only make views or allocate: no kernel, no data read (.to() counts as the
              # copy_ under it, if any)
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::as_strided", "aten::expand", "aten::slice",
    "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose", "aten::permute",
    "aten::alias", "aten::detach", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::unbind",
    "aten::narrow", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
           "aten::lift_fresh",
    "aten::_reshape_alias", "aten::unflatten", "aten::flatten", "aten::view_as", "aten::expand_as",
    "aten::contiguous", "aten::numpy_T", "aten::result_type", "aten::is_nonzero", "aten::_local_scalar_dense",
    "aten::unfold", "aten::as_strided_", "aten::resolve_conj", "aten::resolve_neg",
    "aten::to", "aten::_to_copy", "aten::type_as", "aten::unsqueeze_", "aten::squeeze_"}


@dataclass
class StepOps:
    device: str
    steps: int
    tokens: int                # decoded in the counted steps
    layers: int
    per_step: float            # operations per step, all of it
    per_layer: float           # inside one decoder layer's forward (the fewest of any), per step
    outside_layers: float      # per step: the rest (per-pass tables, embedding, lm_head, sampling, proposer)
    by_name: dict = field(default_factory=dict)   # per step, the most frequent first
    # microseconds per step (CUDA: device time), the longest first
    time_by_name: dict = field(default_factory=dict)

    @property
    def per_token(self) -> float:
        return self.per_step * self.steps / max(1, self.tokens)

    def as_dict(self) -> dict:
        return {"device": self.device, "steps": self.steps, "tokens": self.tokens, "layers": self.layers,
                "per_step": round(self.per_step, 1), "per_layer": round(self.per_layer, 2),
                "outside_layers": round(self.outside_layers, 1), "per_token": round(self.per_token, 1),
                "by_name": {k: round(v, 2) for k, v in self.by_name.items()},
                "time_by_name_us": {k: round(v, 1) for k, v in self.time_by_name.items()}}


@contextlib.contextmanager
def layer_ranges(model):
    """Each decoder layer's forward inside a LAYER profiler range (an instance attribute over the
    class's forward, removed after)."""
    layers = list(model.model.layers)
    for layer in layers:
        def ranged(*args, _forward=layer.forward, **kwargs):
            with record_function(LAYER):
                return _forward(*args, **kwargs)
        layer.forward = ranged
    try:
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward


def working_cpu_ops(event) -> list:
    """The aten ops at and under `event` that do work themselves (the lowest working ones)."""
    below = [op for child in event.cpu_children for op in working_cpu_ops(child)]
    if below:
        return below
    works = event.name.startswith("aten::") and event.name not in NO_WORK
    return [event] if works else []


def device_ops(events) -> tuple[list, list[int]]:
    """CUDA: (the device's own records: kernels, copies, memsets; each layer's count). A profiler
    range shows up twice, as a host event and as a device-side annotation spanning the kernels
    launched inside it; the annotation is not work (it was once counted as one operation a layer).
    A layer's kernels are those that ran inside its device-side span."""
    cuda = torch.autograd.DeviceType.CUDA
    spans = [e.time_range for e in events if e.device_type == cuda and e.name == LAYER]
    ops = [e for e in events
           if e.device_type == cuda and not getattr(e, "is_user_annotation", False) and e.name != LAYER]
    starts = sorted(op.time_range.start for op in ops)
    layers = [bisect.bisect_right(starts, span.end) - bisect.bisect_left(starts, span.start)
              for span in spans]
    return ops, layers


def count_step_ops(engine, steps: int) -> StepOps:
    """Run `steps` engine steps (requests already decoding) under the profiler and count their
    operations. On CUDA the device's own records count (kernels, copies, memsets) per step; per
    layer, those inside a LAYER range's device-side span (device_ops)."""
    cuda = engine.device.type == "cuda"
    requests = list(engine.scheduler.running)
    before = sum(len(r.output_ids) for r in requests)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with layer_ranges(engine.model) as num_layers, profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    tokens = sum(len(r.output_ids) for r in requests) - before
    events = prof.events()
    if cuda:
        ops, layers = device_ops(events)
    else:
        roots = [e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU]
        ops = [op for root in roots for op in working_cpu_ops(root)]
        layers = [len(working_cpu_ops(e)) for e in events if e.name == LAYER]
    names, times = collections.Counter(), collections.Counter()
    for op in ops:
        names[op.name] += 1 / steps
        times[op.name] += (op.time_range.elapsed_us() if cuda else op.self_cpu_time_total) / steps
    if len(layers) != num_layers * steps:   # never a silent 0: each step's forward runs each layer once
        raise RuntimeError(f"the profiler saw {len(layers)} decoder-layer ranges in {steps} steps of a "
                           f"{num_layers}-layer model, not {num_layers * steps}: operations per layer "
                           "unmeasured (a CUDA graph's replay runs no layer's Python: count an eager engine)")
    per_layer = min(layers)
    return StepOps(engine.device.type, steps, tokens, num_layers, len(ops) / steps, per_layer,
                   len(ops) / steps - per_layer * num_layers, dict(names.most_common(25)),
                   dict(times.most_common(25)))
