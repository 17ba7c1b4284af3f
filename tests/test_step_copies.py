"""Host/device traffic of a decode step, counted on CPU where every tensor built from host data
(torch.tensor, torch.as_tensor, torch.from_numpy) and every copy out of the step's host buffer
would be a host-to-device copy on CUDA, and every .tolist() / .item() / .cpu() / .numpy() of a
result a device-to-host copy: for every proposer, one copy in (cuda_graph.py's upload: sampling
parameters, block-table updates, last tokens, n-gram's drafts, a model proposer's whole round) and
one copy back (tokens, accepted counts, finiteness flags)."""
import pytest
import torch

from conftest import PROMPTS, greedy, proposer_args
from nanospec import LLM
from nanospec.cuda_graph import StepOptions
from nanospec.dynamic_k import past_prefill


def count_decode_step_copies(llm, batch: int, monkeypatch) -> tuple[int, int]:
    engine = llm.engine
    engine.add_requests([engine.new_request(i, p, llm.encode_prompt(p), greedy(40))
                         for i, p in enumerate((PROMPTS * 4)[:batch])])
    past_prefill(engine)
    engine.step()   # the proposer's first step catches up on the prompt
    made, read = [], []
    host = engine.step_graphs.host.untyped_storage().data_ptr()
    for name in ("tensor", "as_tensor", "from_numpy"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, real=real, **kw: (made.append(1), real(*a, **kw))[1])
    for name in ("tolist", "item", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, real=real, **kw: (
            read.append(self.untyped_storage().data_ptr() != host), real(self, *a, **kw))[1])
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **kw: (
        made.append(src.untyped_storage().data_ptr() == host), real_copy(self, src, *a, **kw))[1])
    engine.step()
    monkeypatch.undo()
    return sum(made), sum(read)   # the step's own numpy() view of its host buffer is not a read


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("name", ["plain", "ngram", "draft", "eagle1", "eagle3"])
def test_a_decode_step_copies_back_once(spec_models, monkeypatch, name, batch):
    args = {} if name == "plain" else {**proposer_args(spec_models, name), "num_speculative_tokens": 3}
    # The CPU attention's mirror (kv_mirror.py) plans each pass from the metadata on the host; it never
    # runs on a device, so the step is counted as a GPU runs it: with the reference attention.
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=16,
              step_options=StepOptions(pad_batches=True, kv_mirror=False), **args)
    made, read = count_decode_step_copies(llm, batch, monkeypatch)
    assert read == 1
    assert made == 1   # K = 3 draft steps included
