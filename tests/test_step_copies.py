"""Host/device traffic of a decode step, counted on CPU where every tensor built from host data
(torch.tensor) would be a host-to-device copy on CUDA, and every .tolist() a device-to-host copy:
one copy back for every proposer; two copies in (the sampling parameters, then the attention
metadata with everything else the step needs) for plain decoding and n-gram, and one more per
draft step for a draft model or an EAGLE head (the first carries the whole round's rows and
positions; each later one is that step's attention metadata). One copy in per step, with the
draft round's metadata derived on the device, is still ahead (issue 31)."""
import pytest
import torch

from conftest import PROMPTS, greedy, proposer_args
from nanospec import LLM


def count_decode_step_copies(llm, batch: int, monkeypatch) -> tuple[int, int]:
    engine = llm.engine
    engine.add_requests([engine.new_request(i, p, llm.encode_prompt(p), greedy(40))
                         for i, p in enumerate((PROMPTS * 4)[:batch])])
    while engine.scheduler.waiting or any(r.in_prefill for r in engine.scheduler.running):
        engine.step()
    engine.step()   # the proposer's first step catches up on the prompt
    made, read = [], []
    real_tensor, real_tolist = torch.tensor, torch.Tensor.tolist
    monkeypatch.setattr(torch, "tensor", lambda *a, **kw: (made.append(1), real_tensor(*a, **kw))[1])
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (read.append(1), real_tolist(self))[1])
    engine.step()
    monkeypatch.undo()
    return len(made), len(read)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("name", ["plain", "ngram", "draft", "eagle1", "eagle3"])
def test_a_decode_step_copies_back_once(spec_models, monkeypatch, name, batch):
    args = {} if name == "plain" else {**proposer_args(spec_models, name), "num_speculative_tokens": 3}
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=16, **args)
    made, read = count_decode_step_copies(llm, batch, monkeypatch)
    assert read == 1
    assert made == (2 if name in ("plain", "ngram") else 2 + 3)   # K = 3 draft steps
