"""Logprobs: each output token's log-probability under the target and the N most likely tokens at its
position, as vLLM gives them by default (raw: the log-softmax of the target's logits, before
temperature and truncation), checked against transformers' forward over the prompt and the output."""
import pytest
import torch

from conftest import PROMPTS, proposer_args
from nanospec import LLM, NanospecError, SamplingParams

KV = dict(device="cpu", dtype="float32", kv_cache_gb=0.02)


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), vocab] float64: the log-softmax of transformers' logits at the positions that
    predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("proposer", ["plain", "ngram", "self_draft", "eagle1"])
def test_logprobs_are_the_targets_at_every_emitted_position(spec_models, proposer):
    """A batch whose requests ask for different N (and one for none), greedy and sampled: every
    output token's logprob and its position's top N equal transformers' to float32 precision,
    accepted drafts' positions included (self-drafting accepts every draft at T = 0)."""
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32)
    proposer_kwargs = {} if proposer == "plain" else proposer_args(spec_models, proposer)
    llm = LLM(spec_models["target"], **KV, **proposer_kwargs)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=1),
              SamplingParams(temperature=0.8, top_k=5, max_tokens=12, ignore_eos=True, seed=2, logprobs=0),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20)]
    outputs = llm.generate(PROMPTS[:4], params)
    assert outputs[1].logprobs is None
    for out, p in zip(outputs, params):
        if p.logprobs is None:
            continue
        expected = reference_logprobs(reference, out.prompt_token_ids, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (token, got) in enumerate(zip(out.token_ids, out.logprobs)):
            assert next(iter(got)) == token   # its own first
            top = expected[i].topk(p.logprobs)
            assert set(got) == set(top.indices.tolist()) | {token}
            for t, value in got.items():
                assert value == pytest.approx(expected[i, t].item(), abs=2e-4)


def test_logprobs_beyond_20_are_refused(tiny_llm):
    for bad in (21, -1, 2.0, True):
        with pytest.raises(NanospecError, match="logprobs must be an integer"):
            tiny_llm.generate("a", SamplingParams(max_tokens=2, logprobs=bad))


def test_more_logprobs_than_a_vocabulary_holds_are_all_of_it(tmp_path):
    """A toy vocabulary of 16 ids and logprobs = 20: every id's, not a failed step."""
    from conftest import write_checkpoint
    folder = write_checkpoint(str(tmp_path / "toy"), "qwen3", vocab_size=300, model_vocab=16)
    out = LLM(folder, **KV).generate([[1, 2]], SamplingParams(temperature=0, max_tokens=3, logprobs=20))[0]
    assert [len(e) for e in out.logprobs] == [16] * 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("proposer", ["plain", "self_draft"])
def test_cuda_logprobs_are_the_cpus(spec_models, proposer):
    """On CUDA (graphs for the other steps, a logprobs step eagerly), float32: the same tokens and
    logprobs as on the CPU, within float32 noise, a request without logprobs beside them."""
    args = {} if proposer == "plain" else proposer_args(spec_models, proposer)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3)]
    outs = {device: LLM(spec_models["target"], device=device, dtype="float32", num_kv_blocks=200, **args)
            .generate(PROMPTS[:2], params) for device in ("cpu", "cuda")}
    (cpu, _), (cuda, _) = outs["cpu"], outs["cuda"]
    assert cuda.token_ids == cpu.token_ids
    for got, want in zip(cuda.logprobs, cpu.logprobs):
        assert set(got) == set(want) and all(abs(got[t] - want[t]) < 1e-3 for t in want)
