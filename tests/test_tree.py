"""Draft trees are lossless: whatever the tree, and however its candidates were drafted (the drafter's
top-k, drawn with or without replacement), the tokens a walk emits follow the target's distribution.

The target here is a Markov chain over a small vocabulary (p after a path depends on its last token,
as a model's on the path), so a node's p is a function of its path, as in a real tree. A walk stops
where it leaves the tree; continued by the target itself to a fixed length L, its output must have
exactly the target's law over L tokens. That is computed in float64 from the module's own pieces
(as test_rejection does for the chain) over Hypothesis trees; the batched sampler is checked against
it by a chi-square test, token for token against plain sampling where the candidates are deterministic,
and against the chain's rejection sampler on chains. Mutants of the module each fail these tests."""
import itertools
import pathlib
import types

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from chisquare import chi_square_pvalue
from conftest import tree_path
from nanospec import sampler, tree
from nanospec.sampler import EMIT, pick, rejection_sample, target_probs, uniform_noise

logit = st.one_of(st.floats(-2, 2), st.floats(-2, 2), st.just(float("-inf")))   # -inf: probability 0
KINDS = ("top_k", "with_replacement", "without_replacement")


@st.composite
def distribution(draw, vocab):
    """A row of probabilities after one temperature / top-k / top-p (greedy: one-hot), in float64."""
    logits = [draw(st.floats(-2, 2))] + draw(st.lists(logit, min_size=vocab - 1, max_size=vocab - 1))
    probs = target_probs(torch.tensor([logits]), torch.tensor([draw(st.sampled_from([1.0, 0.7, 2.0, 0.0]))]),
                         torch.tensor([draw(st.integers(0, vocab))]),
                         torch.tensor([draw(st.sampled_from([1.0, 0.6]))]))[0].double()
    return probs / probs.sum()


@st.composite
def trees(draw):
    """A target P [V, V], a drafter Q [V, V] (rows: the last token), a tree's parent list, and how each
    node's children were drafted."""
    vocab = draw(st.integers(2, 5))
    P = torch.stack([draw(distribution(vocab)) for _ in range(vocab)])
    Q = torch.stack([draw(distribution(vocab)) for _ in range(vocab)])
    parents = [-1]
    for i in range(1, draw(st.integers(1, 6))):
        parents.append(draw(st.integers(0, i - 1)))
    kinds = [draw(st.sampled_from(KINDS)) for _ in parents]
    return P, Q, parents, kinds, draw(st.integers(0, vocab - 1))


def children_of(parents, n):
    return [i for i in range(1, len(parents)) if parents[i] == n]


def drafts(q: torch.Tensor, m: int, kind: str, module=tree):
    """Every way m children can be drafted from q [V]: (probability, tokens, q_j of each) in float64.
    Without replacement, a drafter whose q has run out drafts fewer."""
    if kind == "top_k":   # deterministic: the m most likely, each with a one-hot q_j
        top = sampler.ranked(q[None], None)[0][:m].tolist()
        yield 1.0, top, [torch.nn.functional.one_hot(torch.tensor(x), len(q)).double() for x in top]
        return

    def draws(xs, prob):
        left = q.clone()
        if kind == "without_replacement":   # the drawing itself, independent of the module
            left[xs] = 0
        if len(xs) == m or left.sum() == 0:
            yield prob, xs
            return
        for x in range(len(q)):
            if left[x] > 0:
                yield from draws(xs + [x], prob * float(left[x] / left.sum()))

    for prob, xs in draws([], 1.0):
        yield prob, xs, [q if kind == "with_replacement" else module.sibling_proposal(q, xs[:j])
                         for j in range(len(xs))]


def continued(law: dict, P: torch.Tensor, length: int) -> dict:
    """Each sequence of `law` continued by the target (a Markov chain) to `length` tokens."""
    while any(len(s) < length for s in law):
        nxt = {}
        for s, w in law.items():
            if len(s) == length:
                nxt[s] = nxt.get(s, 0.0) + w
                continue
            for y in range(P.shape[1]):
                if P[s[-1], y] > 0:
                    nxt[s + (y,)] = nxt.get(s + (y,), 0.0) + w * float(P[s[-1], y])
        law = nxt
    return law


def walk_law(P, Q, parents, kinds, node, token, module=tree) -> dict:
    """The exact law of the tokens a walk emits from `node` (whose token is `token`), in float64."""
    p, kids = P[token], children_of(parents, node)
    law: dict = {}
    for prob, xs, q_js in drafts(Q[token], len(kids), kinds[node], module):
        reach, r, weights = prob, p, p
        for kid, x, q_j in zip(kids, xs, q_js):
            accept = float(sampler.acceptance_probability(r[x:x + 1], q_j[x:x + 1]))
            for s, w in walk_law(P, Q, parents, kinds, kid, x, module).items():
                law[(x,) + s] = law.get((x,) + s, 0.0) + reach * accept * w
            reach *= 1 - accept
            weights = sampler.next_token_weights(r[None], q_j[None], torch.tensor([True]))[0]
            r = module.renormalized(weights)
        for y in range(len(p)):
            law[(y,)] = law.get((y,), 0.0) + reach * float(weights[y] / weights.sum())
    return law


def target_law(P, root_token, length):
    return continued({(y,): float(P[root_token, y]) for y in range(P.shape[1])}, P, length)


def max_error(P, Q, parents, kinds, root_token, module=tree) -> float:
    length = max(tree.depths(parents)) + 1
    law = continued(walk_law(P, Q, parents, kinds, 0, root_token, module), P, length)
    want = target_law(P, root_token, length)
    return max(abs(law.get(s, 0.0) - want.get(s, 0.0)) for s in set(law) | set(want))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(case=trees())
def test_a_tree_walk_emits_the_target_distribution_exactly(case):
    assert max_error(*case) < 1e-12


def test_sibling_proposal_is_q_without_the_earlier_siblings():
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    assert torch.allclose(tree.sibling_proposal(q, [0]), torch.tensor([0.0, 0.6, 0.4], dtype=torch.float64))


# -- the tree's shape --------------------------------------------------------------------------------------

def test_a_static_tree_is_read_as_vllm_writes_it():
    assert tree.parse_static_tree("[(0,), (1,), (0, 0), (0, 1), (1, 0)]") == [-1, 0, 0, 1, 1, 2]
    assert tree.parse_static_tree([(0,), (0, 0), (0, 0, 0)]) == tree.chain(3)
    for bad in ["[(1,)]", "[(0, 0)]", "[(0,), (0,)]", "[(0,), (-1,)]", "nonsense", "[()]"]:
        with pytest.raises(ValueError, match="is not a list of tuples|is not a new path|comes before its"):
            tree.parse_static_tree(bad)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool, on the host: True where node j is node i's ancestor or i itself."""
    return torch.tensor([[j in (0, *tree_path(parents, i)) for j in range(len(parents))]
                         for i in range(len(parents))])


def test_a_node_sees_its_ancestors_and_itself():
    parents = [-1, 0, 0, 1, 2, 3]
    mask = tree.ancestors_of(torch.tensor([parents]), 5)[0]
    for i in range(len(parents)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == {0, *tree_path(parents, i)}
    assert tree.depths(parents) == [0, 1, 1, 2, 2, 3]
    assert tree.child_ranks(parents) == [0, 0, 1, 0, 0, 0]


def test_the_device_depths_and_masks_are_the_host_ones():
    trees_ = [[-1, 0, 0, 1, 2, 3], tree.chain(5), [-1, 0, 1, 1, 0, 4]]
    parents = torch.tensor(trees_)
    padded = torch.cat([parents, torch.full((3, 2), -2)], 1)   # two padding nodes each
    for b, ps in enumerate(trees_):
        assert tree.depths_of(padded, 5)[b, :6].tolist() == tree.depths(ps)
        assert torch.equal(tree.ancestors_of(padded, 5)[b, :6, :6], ancestor_mask(ps))
        assert not tree.ancestors_of(padded, 5)[b, :6, 6:].any()


def test_path_moves_bring_the_accepted_path_in_place():
    slots = list(range(10))   # what offset i holds before: node i's K/V
    for accepted in ([1, 3, 7], [2, 4], [1, 2, 3], [5]):
        held = slots.copy()
        for src, dst in tree.path_moves(accepted):
            held[dst] = held[src]
        assert held[1:len(accepted) + 1] == accepted
    assert tree.path_moves([1, 2, 3]) == []


# -- the batched sampler -----------------------------------------------------------------------------------

ROWS = 40000
P_TABLE = torch.softmax(torch.tensor([[1.0, 0.2, -0.5], [0.1, 0.9, 0.3], [-0.3, 0.6, 1.2]]), -1)
Q_TABLE = torch.softmax(torch.tensor([[0.2, 1.1, -0.2], [0.8, -0.5, 0.3], [1.0, 0.0, -0.4]]), -1)
PARENTS = [-1, 0, 0, 1, 1, 2]   # two children under the root and under node 1, one under node 2
ROOT_TOKEN = 0


def batch_of_trees(kind: str, generator: torch.Generator, module=tree):
    """ROWS trees of PARENTS shape, their candidates drafted from Q_TABLE by `kind`, with p from P_TABLE."""
    n, vocab = len(PARENTS), P_TABLE.shape[1]
    tokens = torch.zeros(ROWS, n, dtype=torch.long)
    tokens[:, 0] = ROOT_TOKEN
    q = torch.zeros(ROWS, n, vocab)
    for node in range(n):
        kids = children_of(PARENTS, node)
        for j, kid in enumerate(kids):
            q_rows = Q_TABLE[tokens[:, node]]
            if kind == "top_k":
                x = q_rows.argsort(dim=-1, descending=True, stable=True)[:, j]
                q[:, kid] = torch.nn.functional.one_hot(x, vocab).float()
            elif kind == "with_replacement" or not j:
                x = torch.multinomial(q_rows, 1, generator=generator)[:, 0]
                q[:, kid] = q_rows
            else:   # drawn without the earlier siblings' tokens; q_j as the module reports it
                earlier = tokens[:, kids[:j]]
                x = torch.multinomial(q_rows.scatter(1, earlier, 0.0), 1, generator=generator)[:, 0]
                q[:, kid] = torch.stack([module.sibling_proposal(q_rows[b], earlier[b].tolist())
                                         for b in range(ROWS)]).float()
            tokens[:, kid] = x
    p = P_TABLE[tokens]   # [ROWS, n, V]: the target after each node's token
    return p, tokens, q


def run_walk(kind: str, module=tree, seed=0):
    g = torch.Generator().manual_seed(seed)
    p, tokens, q = batch_of_trees(kind, g, module)
    parents = torch.tensor(PARENTS).expand(ROWS, -1)
    seeds, positions = torch.arange(ROWS) + 1000 * seed, torch.full((ROWS,), 7)
    depth = max(tree.depths(PARENTS))
    q = None if kind == "top_k" else q
    out, path, accepted = module.tree_rejection_sample(p, tokens, parents, q, seeds, positions, depth, 2)
    return out, path, accepted, tokens, positions, seeds


def continued_rows(out, accepted, length, g):
    """Each row's emitted tokens continued by the target to `length` tokens."""
    seqs = out.clone()
    for d in range(1, length):
        nxt = torch.multinomial(P_TABLE[seqs[:, d - 1]], 1, generator=g)[:, 0]
        seqs[:, d] = torch.where(d > accepted, nxt, seqs[:, d])
    return seqs


def walk_pvalue(kind: str, module=tree) -> float:
    out, _, accepted, *_ = run_walk(kind, module)
    length = out.shape[1]
    seqs = continued_rows(out, accepted, length, torch.Generator().manual_seed(1))
    want = target_law(P_TABLE.double(), ROOT_TOKEN, length)
    cells = list(itertools.product(range(3), repeat=length))
    index = (seqs * torch.tensor([3 ** (length - 1 - d) for d in range(length)])).sum(-1)
    counts = torch.bincount(index, minlength=len(cells)).double()
    return chi_square_pvalue(counts, torch.tensor([want.get(c, 0.0) for c in cells]))


@pytest.mark.parametrize("kind", ["with_replacement", "without_replacement"])
def test_the_batched_walk_emits_the_target_distribution(kind):
    assert walk_pvalue(kind) > 1e-4


def test_deterministic_candidates_emit_what_plain_sampling_emits():
    """With top-k candidates (q None), every emitted token is the target's own draw at its position
    after the path so far, with the EMIT noise plain sampling uses there."""
    out, path, accepted, tokens, positions, seeds = run_walk("top_k")
    prev = torch.full((ROWS,), ROOT_TOKEN)
    for d in range(out.shape[1]):
        plain = pick(P_TABLE[prev], uniform_noise(seeds, positions + d, EMIT))
        live = d <= accepted
        assert torch.equal(out[live, d], plain[live])
        if d < path.shape[1]:   # the path goes down exactly where the emitted token is a child's
            went = d < accepted
            assert torch.equal(tokens.gather(1, path[:, d:d + 1])[went, 0], out[went, d])
        prev = out[:, d]
    assert (accepted > 0).any() and (accepted == 0).any() and (accepted == 2).any()


@pytest.mark.parametrize("one_hot", [False, True])
def test_a_chain_walks_as_the_chain_rejection_sampler(one_hot):
    """A chain is a tree: on one, the walk is rejection_sample token for token, with each row's own K."""
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 256, 4, 7
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=g).view(batch, k)
    num_draft = torch.randint(0, k + 1, (batch,), generator=g)
    temperature = torch.where(torch.arange(batch) % 4 == 0, 0.0, 0.8)
    seeds, positions = torch.arange(batch), torch.randint(0, 100, (batch,), generator=g)
    args = (temperature, torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    want, want_accepted = rejection_sample(logits, draft_ids, None if one_hot else draft_probs, num_draft,
                                           *args, seeds, positions)
    rows = (x.repeat_interleave(k + 1) for x in args)
    p = target_probs(logits.view(-1, vocab), *rows).view(batch, k + 1, vocab)
    parents = torch.tensor(tree.chain(k)).expand(batch, -1).clone()
    parents[torch.arange(k + 1)[None, :] > num_draft[:, None]] = -2
    tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), draft_ids], 1)
    q = None if one_hot else torch.cat([torch.zeros(batch, 1, vocab), draft_probs], 1)
    out, path, accepted = tree.tree_rejection_sample(p, tokens, parents, q, seeds, positions, k, 1)
    assert torch.equal(accepted, want_accepted)
    for b in range(batch):
        n = int(accepted[b]) + 1
        assert out[b, :n].tolist() == want[b, :n].tolist()
        assert path[b, :n - 1].tolist() == list(range(1, n))


# -- mutants: each is a one-line change of nanospec/tree.py, and each fails a test above -------------------

SOURCE = pathlib.Path(tree.__file__).read_text()
MUTANTS = {
    "residual not renormalized": ("    return weights / weights.sum(-1, keepdim=True)", "    return weights"),
    "siblings not excluded": ("    q[earlier] = 0.0\n", ""),
    "bonus drawn at the parent": (
        "        children = parents == node[:, None]",
        "        children = parents == node[:, None]\n"
        "        node = torch.where(~children.any(-1), parents[rows, node].clamp(min=0), node)"),
}


def mutant(name: str) -> types.ModuleType:
    old, new = MUTANTS[name]
    assert SOURCE.count(old) == 1, name
    module = types.ModuleType(f"tree_{name.replace(' ', '_')}")
    exec(compile(SOURCE.replace(old, new), module.__name__, "exec"), module.__dict__)
    return module


def holds_on_hypothesis_trees(module) -> bool:
    """The exact-law property over 300 Hypothesis trees, with `module` as the sampler (no shrinking)."""
    @settings(max_examples=500, deadline=None, database=None, phases=[Phase.generate], derandomize=True)
    @given(case=trees())
    def check(case):
        assert max_error(*case, module=module) < 1e-12
    try:
        check()
    except AssertionError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTANTS))
def test_these_tests_fail_on_a_broken_tree_sampler(name):
    broken = mutant(name)
    if name == "bonus drawn at the parent":   # the walk itself: the batched sampler's tests
        assert walk_pvalue("with_replacement", broken) < 1e-4
        return
    assert not holds_on_hypothesis_trees(broken)
    assert walk_pvalue("without_replacement", broken) < 1e-4


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.sampled_from([0.0, -0.1, -0.7, -0.7, -2.0])),
                min_size=1, max_size=12), st.integers(1, 12), st.integers(1, 12))
def test_rerank_numbers_a_trees_nodes_best_first(candidates, small, large):
    """EAGLE-2's rerank: candidate c's parent is an earlier candidate (or the root), its score its
    parent's plus a log-probability <= 0 (ties included). Node i + 1 is the i-th best candidate (ties:
    the earlier), so a parent comes before its children, and a budget of n keeps the first n nodes
    of any larger budget's tree: the budget policy's position i is the same node whatever K it asks."""
    parents, scores = [], []
    for c, (parent, step) in enumerate(candidates):
        parent = parent % (c + 1) - 1   # -1 (the root) or an earlier candidate
        parents.append(parent)
        scores.append(step + (scores[parent] if parent >= 0 else 0.0))
    small, large = sorted((min(small, len(scores)), min(large, len(scores))))
    as_rows = lambda x, dtype: torch.tensor([x], dtype=dtype)   # noqa: E731
    tokens = as_rows(list(range(100, 100 + len(scores))), torch.long)
    trees = [tree.rerank(as_rows(scores, torch.float64), tokens, as_rows(parents, torch.long),
                         torch.tensor([n]), n) for n in (small, large)]
    (few, few_parents), (many, many_parents) = [(t[0].tolist(), p[0].tolist()) for t, p in trees]
    assert few == many[:small] and few_parents == many_parents[:small + 1]
    order = sorted(range(len(scores)), key=lambda c: (-scores[c], c))[:large]
    assert many == [100 + c for c in order]
    assert many_parents == [-1] + [0 if parents[c] < 0 else order.index(parents[c]) + 1 for c in order]
