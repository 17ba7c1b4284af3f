"""The work a decode step launches, counted with the torch profiler (benchmarks/step_ops.py) and
pinned: a change that adds operations to a decoder layer or to a decoded token fails here. The lean
pieces that bring the count down (rotation with tables made once per pass, the additive mask made
once, no boolean row selection) compute what the readable references compute, bit for bit."""
import pytest
import torch

from benchmarks.measure import decoding
from benchmarks.step_ops import LAYER, count_step_ops
from nanospec import LLM, model as model_module
from nanospec.bench import oracle_proposer
from nanospec.dynamic_k import twin
from nanospec.k_policy import StaticK
from nanospec.kv_cache import build_metadata, paged_attention_reference
from nanospec.model import RotaryEmbedding

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [3, 3, 8, 120, 64], [77, 12, 1, 9, 9, 30, 2, 5, 6], [15, 250, 4]]
# The pinned counts (CPU, float32, torch 2.13, a 2-layer Llama-3 checkpoint): operations inside one
# decoder layer per step, and in the whole step per decoded token (oracle drafts, every one
# accepted). Before the lean step (at 65e8178) the same were (70, 210), (51, 33.6), (50, 41.25) and
# (51, 8.4). K and V gathered in one op (their slot index made once per pass: 3 ops a pass, one
# less a layer) took (35, 149), (29, 27.2), (27, 32.75), (29, 6.8) to the figures below: a token
# of this 2-layer model costs a little more, one of any model of more than 3 layers less.
# The CPU attention's mirror (kv_mirror.py: the K/V written to the mirror instead of gathered from
# the pool, a block copied in when a row first reaches it, and the pass's K/V written to the pool in
# its last layer) took (34, 150), (28, 27.4), (26, 33.0) and (28, 6.85) to the figures below: a
# middle layer runs one op fewer, the last layer two more, and this model's two layers are both first
# or last (measured on 4 layers: 34 -> 33 a layer); at batch 4 with K = 4 the block copies (2 ops a
# layer in a step where a row reaches a new block) cost this 2-layer model a little more a token.
# Other torch versions decompose some ops otherwise: the pins hold for the CI's.
PINNED = {(1, 0): (35, 146), (1, 4): (29, 27.0), (4, 0): (27, 32.0), (4, 4): (29, 6.92)}


def decoding_engine(llm: LLM, batch: int, k: int):
    """A twin of llm's engine with `batch` greedy requests past prefill, K = k oracle drafts."""
    prompts = PROMPTS[:batch]
    oracle = oracle_proposer(llm.engine, prompts, 40) if k else None
    engine = twin(llm.engine, 64, max_num_seqs=batch, k_policy=StaticK(k), proposer=oracle)
    decoding(engine, prompts, 40)
    return engine


@pytest.fixture(scope="module")
def llama(checkpoints):
    return LLM(checkpoints["llama3"], device="cpu", dtype="float32", kv_cache_gb=0.02)


@pytest.mark.slow
@pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                    reason="the pins are counted on torch 2.13 (CI's)")
@pytest.mark.parametrize("batch,k", list(PINNED))
def test_a_decode_layer_and_a_token_launch_no_more_than_the_pinned_operations(llama, batch, k):
    ops = count_step_ops(decoding_engine(llama, batch, k), steps=4)
    per_layer, per_token = PINNED[batch, k]
    assert ops.tokens == 4 * batch * (k + 1)   # every draft accepted: the steps were full ones
    assert ops.per_layer <= per_layer, ops.as_dict()
    assert ops.per_token <= per_token + 1e-9, ops.as_dict()


def test_the_count_sees_one_more_operation_in_each_layer(llama, monkeypatch):
    """The counter is not blind: one added elementwise op per layer is one more per layer."""
    before = count_step_ops(decoding_engine(llama, 1, 0), steps=3)
    real = model_module.MLP.forward
    monkeypatch.setattr(model_module.MLP, "forward", lambda self, x: real(self, x) * 1.0)
    after = count_step_ops(decoding_engine(llama, 1, 0), steps=3)
    assert after.per_layer == before.per_layer + 1 and after.outside_layers == before.outside_layers


def test_a_count_that_saw_no_layer_is_refused_not_zero(llama, monkeypatch):
    """Layers that ran outside their ranges (as a CUDA graph's replay runs them) are not 0 a layer."""
    import contextlib
    from benchmarks import step_ops
    monkeypatch.setattr(step_ops, "layer_ranges",
                        lambda model: contextlib.nullcontext(len(model.model.layers)))
    with pytest.raises(RuntimeError, match="operations per layer unmeasured"):
        count_step_ops(decoding_engine(llama, 1, 0), steps=2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_count_sees_each_layers_kernels_and_one_more(checkpoints, monkeypatch):
    """On CUDA the device's records are counted: each layer's kernels (inside its range's
    device-side span), not the range itself; one added elementwise op per layer is one more kernel
    per layer and none outside."""
    llm = LLM(checkpoints["llama3"], device="cuda", dtype="bfloat16", kv_cache_gb=0.05, enforce_eager=True)
    before = count_step_ops(decoding_engine(llm, 1, 0), steps=3)
    assert before.per_layer >= 5 and LAYER not in before.by_name, before.as_dict()
    real = model_module.MLP.forward
    monkeypatch.setattr(model_module.MLP, "forward", lambda self, x: real(self, x) * 1.0)
    after = count_step_ops(decoding_engine(llm, 1, 0), steps=3)
    assert after.per_layer == before.per_layer + 1 and after.outside_layers == before.outside_layers, (
        before.as_dict(), after.as_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_with_tables_is_the_reference_bit_for_bit(llama, dtype):
    rope = llama.model.model.rotary   # Llama 3's rescaled frequencies
    x = torch.randn(9, 6, rope.cos.shape[1] * 2).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 2, 2, 40, 8])
    assert torch.equal(RotaryEmbedding.rotate(x, *rope.tables(positions)), rope(x, positions))


def test_attention_with_uneven_rows_equals_each_sequence_alone():
    """Sequences adding 1, 3 and 2 tokens in one pass (the padded layout with padding rows, the rows
    taken back by index): each equals the same sequence's pass alone."""
    torch.manual_seed(0)
    cache = torch.randn(2, 12, 4, 2, 16)   # K and V pages
    tables, cached, lens = [[2, 3], [4, 5, 6], [7]], [5, 6, 1], [1, 3, 2]
    q = torch.randn(sum(lens), 4, 16)
    together = paged_attention_reference(q, cache,
                                         build_metadata(tables, cached, lens, 4, torch.device("cpu")),
                                         scale=0.25)
    start = 0
    for table, c, n in zip(tables, cached, lens):
        alone = paged_attention_reference(q[start:start + n], cache,
                                          build_metadata([table], [c], [n], 4, torch.device("cpu")),
                                          scale=0.25)
        assert torch.allclose(together[start:start + n], alone, atol=1e-6)
        start += n
