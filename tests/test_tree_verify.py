"""A draft tree verified in one target forward is lossless end to end: greedy and seeded sampled output
equal plain decoding token for token, whatever the tree (deterministic candidates are walked with plain
sampling's own draws, tree.walk_ids), in every way a step runs on a CPU (padded to the graphs' buckets,
rehearsed as capture and replay, the reference attention or its mirror). Each piece of the tree's
verification is shown to matter: without the tree mask, the rotary positions at each node's depth, or
moving the accepted path's K/V in place, the output changes."""
import random

import pytest

from conftest import PROMPTS, assert_no_leak, greedy
from nanospec import LLM, SamplingParams
from nanospec import cuda_graph
from nanospec.cuda_graph import StepOptions
from nanospec.errors import NanospecError
from nanospec.kv_cache import KVCache
from nanospec.proposer import Proposal, Proposer
from nanospec.suffix import SuffixProposer

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
# penalties count the drafts on each node's path (logits_processors.penalize)
PENALIZED = SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2)


class TreeOracle(Proposer):
    """Trees around the target's own continuation: at each level, sometimes a wrong sibling first, then
    the true token (sometimes a wrong one instead); K nodes in all."""
    drafts_on_host = True

    def __init__(self, continuations: dict[str, list[int]], seed: int = 0):
        self.continuations, self.rng = continuations, random.Random(seed)

    def propose(self, requests, ks) -> Proposal:
        drafts, parents = [], []
        for req, k in zip(requests, ks):
            done = len(req.tokens) - len(req.prompt_ids)
            tokens, tree, node = [], [-1], 0
            for true in self.continuations[req.prompt][done:done + k]:
                if len(tokens) + 2 > k:
                    break
                if self.rng.random() < 0.5:
                    tokens.append((true + 1) % 300)
                    tree.append(node)
                tokens.append(true if self.rng.random() < 0.8 else (true + 7) % 300)
                tree.append(node)
                node = len(tokens)
            drafts.append(tokens)
            parents.append(tree)
        return Proposal([len(d) for d in drafts], drafts, parents=parents)


def decode(target, params, proposer=None, step_options=None, **kwargs):
    llm = LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05, step_options=step_options,
              **({"ngram": True, "num_speculative_tokens": 6} if proposer else {}), **kwargs)
    if proposer:
        llm.engine.proposer = llm.engine.step_graphs.proposer = proposer
    return llm, [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("params", [greedy(), SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"])
@pytest.mark.parametrize("options", [StepOptions(), StepOptions(pad_batches=True, rehearse=True),
                                     StepOptions(kv_mirror=False)], ids=["ragged", "rehearsed", "reference"])
def test_tree_output_equals_plain_decoding(checkpoints, params, options):
    _, want = decode(checkpoints["qwen3"], params, step_options=options)
    llm, got = decode(checkpoints["qwen3"], params, TreeOracle(dict(zip(PROMPTS, want))), options)
    assert got == want
    assert llm.stats["accepted_tokens"] > 0 and llm.stats["drafted_tokens"] > llm.stats["accepted_tokens"]
    assert_no_leak(llm)


def without_mask(meta, *args, mask_tree=cuda_graph.mask_tree):
    positions = mask_tree(meta, *args)
    meta.tree = None
    return positions


def without_depths(meta, *args, mask_tree=cuda_graph.mask_tree):
    mask_tree(meta, *args)
    return meta.positions


@pytest.mark.parametrize("fault", ["no tree mask", "no depth positions", "path not moved"])
def test_each_piece_of_tree_verification_matters(checkpoints, monkeypatch, fault):
    _, want = decode(checkpoints["qwen3"], greedy())
    if fault == "no tree mask":
        monkeypatch.setattr(cuda_graph, "mask_tree", without_mask)
    elif fault == "no depth positions":
        monkeypatch.setattr(cuda_graph, "mask_tree", without_depths)
    else:
        monkeypatch.setattr(KVCache, "move_slots", lambda self, src, dst: None)
    _, got = decode(checkpoints["qwen3"], greedy(), TreeOracle(dict(zip(PROMPTS, want))))
    assert got != want


TREE_PARAMS = {"greedy": greedy(40),
               "sampled": SamplingParams(temperature=0.5, seed=5, max_tokens=40, ignore_eos=True),
               "logprobs": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)}


@pytest.mark.parametrize("params", list(TREE_PARAMS.values()), ids=list(TREE_PARAMS))
def test_suffix_trees_equal_plain_decoding(checkpoints, monkeypatch, params):
    """Suffix decoding's trees (a node's most frequent continuations as its children): the output and
    its logprobs are plain decoding's, the trees branch, and no block is left behind."""
    plain = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    plain = plain.generate(PROMPTS, params)
    branching, propose = [], SuffixProposer.propose

    def spy(self, requests, ks):
        proposal = propose(self, requests, ks)
        branching.extend(any(p != i - 1 for i, p in enumerate(ps) if i) for ps in proposal.parents)
        return proposal
    monkeypatch.setattr(SuffixProposer, "propose", spy)
    llm = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
              num_speculative_tokens=8, speculative_topk=3)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if params.logprobs:
        for got, want in zip(outs, plain):
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert any(branching) and llm.stats["accepted_tokens"] > 0
    assert_no_leak(llm)


def test_a_static_tree_equals_plain_decoding(checkpoints):
    """vLLM's speculative_token_tree, filled by suffix decoding's ranked continuations."""
    plain = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    plain = plain.generate(PROMPTS, greedy(40))
    llm = LLM(checkpoints["qwen3"], device="cpu", dtype="float32", kv_cache_gb=0.05, suffix=True,
              speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")
    assert llm.engine.max_k == 6
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(40))] == [o.token_ids for o in plain]
    assert llm.stats["accepted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("settings,message", [
    (dict(ngram=True, speculative_topk=3), "speculative_topk 3 drafts trees, which suffix decoding, an"),
    (dict(suffix=True, eagle="head", speculative_topk=3), "not the hybrid or n-gram"),
    (dict(eagle="head", speculative_num_steps=3), "speculative_num_steps is the depth of an EAGLE head's"),
    (dict(suffix=True, speculative_topk=0), "speculative_topk"),
    (dict(eagle="head", speculative_token_tree="[(0,)]"), "speculative_token_tree drafts trees, which suffix "
                                                          "decoding draft"),
    (dict(suffix=True, speculative_token_tree="[(0,), (1,)]", speculative_topk=2), "choose one kind of tree"),
    (dict(suffix=True, speculative_token_tree="[(0,), (1,)]", dynamic_k=True), "fixes the drafts a step"),
    (dict(suffix=True, speculative_token_tree="[(0,), (1,)]", num_speculative_tokens=4),
     "num_speculative_tokens 4 differs from the 2 nodes"),
    (dict(suffix=True, speculative_token_tree="[(0, 0)]"), "comes before its parent"),
    (dict(suffix=True, speculative_token_tree="tree"), "is not a list of tuples of child ranks"),
    (dict(eagle="head", speculative_topk=4, num_speculative_tokens=63), "must be an integer in 1..62"),
    (dict(eagle="head", num_speculative_tokens=17), "must be an integer in 1..16")])
def test_tree_settings_are_checked_before_anything_loads(settings, message):
    with pytest.raises(NanospecError, match=message):
        LLM("no/such-model", device="cpu", **settings)


def test_a_drafters_top_k_is_bounded_by_the_vocabulary(tmp_path):
    """EAGLE-2's top-k of a 12-token model: 12 children a node grow a tree that decodes as plain
    decoding; 13 is refused as the model loads, in one line (it was a top-k out of range mid-step)."""
    from conftest import write_checkpoint
    target = write_checkpoint(str(tmp_path / "tiny"), "llama3", seed=3, num_layers=2, model_vocab=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    settings = dict(device="cpu", dtype="float32", kv_cache_gb=0.05, draft=target, speculative_num_steps=3,
                    num_speculative_tokens=8)
    plain = LLM(target, device="cpu", dtype="float32", kv_cache_gb=0.05).generate([[1, 2, 3]], params)
    tree = LLM(target, speculative_topk=12, **settings).generate([[1, 2, 3]], params)
    assert tree[0].token_ids == plain[0].token_ids and len(plain[0].token_ids) == 8
    with pytest.raises(NanospecError, match="speculative_topk 13 is more than the 12 tokens the target"):
        LLM(target, speculative_topk=13, **settings)


def test_a_drafters_tree_steps_see_each_node_after_its_own_path(spec_models, monkeypatch):
    """EAGLE-2's growth (tree.grow_tree) with the target as its own draft model: every frontier node's
    draft logits are the target's own after the request's tokens and that node's path (read off the
    step's tree mask over the nodes fed so far), as a fresh forward in transformers computes them."""
    import torch
    import transformers
    from nanospec import proposer as proposer_module
    reference = transformers.AutoModelForCausalLM.from_pretrained(spec_models["target"], dtype=torch.float32)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              draft=spec_models["target"], num_speculative_tokens=10, speculative_topk=2,
              speculative_num_steps=3)
    fed, checked, next_step = [], [], proposer_module.DraftModelProposer.next_step

    def spy(self, meta, input_ids, hidden):
        logits, carried = next_step(self, meta, input_ids, hidden)
        if meta.tree is not None:   # a frontier: one query a node, after the nodes fed before it
            fed.extend(input_ids.tolist())
            tokens = llm.engine.scheduler.running[0].tokens
            for q, visible in enumerate(meta.tree[1][:, 0]):
                path = [fed[j] for j in torch.nonzero(visible).flatten().tolist()]
                with torch.no_grad():
                    want = reference(torch.tensor([tokens + path])).logits[0, -1]
                assert torch.allclose(logits[q, :len(want)], want, atol=1e-4), path
                checked.append(len(path))
        return logits, carried
    monkeypatch.setattr(proposer_module.DraftModelProposer, "next_step", spy)
    monkeypatch.setattr(proposer_module.DraftModelProposer, "rollback", lambda self, r, f=fed,
                        rollback=proposer_module.DraftModelProposer.rollback: (f.clear(), rollback(self, r)))
    llm.generate([PROMPTS[0]], greedy(12))
    assert checked and max(checked) == 2   # depths 1 and 2 fed (depth 3 is read, never fed)


@pytest.mark.parametrize("params", [greedy(24), SamplingParams(temperature=0.9, seed=4, max_tokens=24,
                                                                 ignore_eos=True)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["eagle1", "eagle3", "draft", "self_draft"])
def test_eagle_2_trees_equal_plain_decoding(spec_models, name, params):
    """EAGLE-2 trees of a head or a draft model (random weights; the target as its own draft accepts
    the greedy path the tree holds): the output is plain decoding's, and no block of either cache is
    left behind."""
    drafter = {"eagle1": dict(eagle=spec_models["eagle1"]), "eagle3": dict(eagle=spec_models["eagle3"]),
               "draft": dict(draft=spec_models["draft"]),
               "self_draft": dict(draft=spec_models["target"])}[name]
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    plain = plain.generate(PROMPTS, params)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              num_speculative_tokens=6, speculative_topk=3, speculative_num_steps=3, **drafter)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert llm.stats["drafted_tokens"] > 0
    if name == "self_draft" and not params.temperature:   # at least the depth-1 argmax, every step
        assert llm.stats["mean_acceptance_length"] > 1.8
    assert_no_leak(llm)


@pytest.mark.parametrize("params", [greedy(48), SamplingParams(temperature=0.9, seed=4, max_tokens=48,
                                                                 ignore_eos=True)], ids=["greedy", "sampled"])
def test_a_tree_may_hold_more_nodes_than_a_chain(spec_models, monkeypatch, params):
    """A tree's nodes are bounded by the GPU kernel's mask (tree.MAX_NODES), not by a chain's 16: a 40-node
    EAGLE-2 tree of the target as its own draft (8 children a node, 6 deep) decodes as plain decoding,
    verifies all 40 nodes in a step, and leaves no block behind."""
    from nanospec.stats import Stats
    plain = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05)
    plain = plain.generate(PROMPTS, params)
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05,
              draft=spec_models["target"], num_speculative_tokens=40, speculative_topk=8,
              speculative_num_steps=6)
    assert llm.engine.max_k == 40
    verified, record = [], Stats.record

    def spy(self, k, ks, num_draft, *args):
        verified.extend(num_draft)
        return record(self, k, ks, num_draft, *args)
    monkeypatch.setattr(Stats, "record", spy)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in plain]
    assert max(verified) == 40
    assert_no_leak(llm)


@pytest.mark.slow
def test_the_tree_cost_harness_measures_trees(spec_models):
    """benchmarks.tree_costs on a tiny checkpoint: both shapes verify their N nodes (the tree's depth
    is below the chain's), and suffix trees' host work is timed inside the step."""
    from benchmarks import tree_costs
    llm = LLM(spec_models["target"], device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_seqs=4,
              suffix=True, num_speculative_tokens=16, speculative_topk=3)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    row = tree_costs.verify_costs(llm, prompts, 6, 2, 3, 2)
    assert row["tree_depth"] == 2 and row["chain_step_ms"] > 0 and row["tree_step_ms"] > 0
    host = tree_costs.host_costs(llm, prompts * 2, 4, 6)
    assert 0 < host["drafting_ms"] < host["step_ms"] and 0 <= host["tree_host_share"] < 1
