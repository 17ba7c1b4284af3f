"""Draft trees: a chain with a mask and a parent list.

A request's tree hangs below its last token, node 0 (the root). Nodes 1 .. N are drafts; node i has a
parent parents[i] < i (a parent comes before its children) and a depth (its distance from the root);
siblings are tried in node order. A chain of K drafts is the tree parents = [-1, 0, 1, .., K - 1].
Verified in one target forward, node i is written to the cache slot num_cached + i, sits at the position
num_cached + depth[i], and sees the context and its own ancestors (`ancestor_mask`). After the step the
accepted path's K/V move down to the slots num_cached + 1 .. (`path_moves`); the rest are rolled back.

Tree speculative sampling (SpecInfer's multi-step speculative sampling, as SGLang verifies EAGLE-2
trees): at a node with target distribution p, its children's tokens x_1, x_2, .. are tried in turn,
x_j drawn from q_j (one-hot for a deterministic candidate, such as a drafter's top-k or a suffix
continuation). With r_1 = p:
  accept x_j with probability min(1, r_j(x_j) / q_j(x_j));
  on rejection r_{j+1} = normalize(max(r_j - q_j, 0)).
If a child is accepted the walk goes down to it; if none is, a token is drawn from the last residual
and the walk ends; at an accepted leaf the bonus token is drawn from the leaf's own p.
Why this emits p: one candidate is the chain's rule (sampler.rejection_sample): accepted x comes out
with min(q_1(x), r_1(x)), a rejection has probability sum max(r_1 - q_1, 0), and what follows it must
emit normalize(max(r_1 - q_1, 0)) = r_2 (which does not depend on which x_1 was rejected). That is the
same problem one candidate further, so by induction the node emits r_1 = p, whatever the q_j are (q_j
may depend on the earlier siblings: drawn without replacement, q_j is q without them, `sibling_proposal`).
A rejected candidate has r_j(x_j) < q_j(x_j), so r_{j+1}(x_j) = 0: a token emitted from a residual is
never a rejected child's, and the walk goes down exactly when the emitted token is a child's.
"""
from __future__ import annotations

import ast
from collections import Counter

import torch

from nanospec.sampler import ACCEPT, EMIT, acceptance_probability, next_token_weights, pick, uniform_noise

SIBLING_STREAM = 16   # the noise stream of the acceptance test of a node's j-th child, j >= 1 (j = 0: ACCEPT)


def chain(k: int) -> list[int]:
    """The parents of a chain of k drafts: [-1, 0, 1, .., k - 1]."""
    return [-1, *range(k)]


def depths(parents: list[int]) -> list[int]:
    """Each node's distance from the root (node 0)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def check_parents(parents: list[int]) -> None:
    """A tree's parent list: node 0 is the root (parent -1), and every other node's parent comes before it."""
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"not a tree's parent list: {parents}; node 0 has parent -1 and node i > 0 a parent "
                         "in 0 .. i - 1")


def tree_shape(trees: list[list[int]]) -> tuple[int, int]:
    """The largest depth and the most children of a node over the trees' parent lists."""
    return (max(max(depths(ps)) for ps in trees),
            max(max(Counter(ps[1:]).values(), default=0) for ps in trees))


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool: True where node j is node i's ancestor or i itself (what i attends to)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's first child down to `node` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def path_moves(accepted_nodes: list[int]) -> list[tuple[int, int]]:
    """(from, to) offsets past num_cached that bring the accepted path's K/V in place: the j-th accepted
    node (1-based), cached at offset node_j, goes to offset j. Nodes are in tree order, so node_j >= j
    and node_j < node_{j+1}: done in order, no move overwrites a slot a later move reads."""
    return [(node, j) for j, node in enumerate(accepted_nodes, start=1) if node != j]


def parse_static_tree(spec: str | list) -> list[int]:
    """A vLLM `speculative_token_tree` ("[(0,), (1,), (0, 0)]": each node the path of child ranks from
    the root, breadth first) as a parent list over nodes 0 .. N, node 0 the root; a node's children are
    its drafter's top candidates in rank order. Raises ValueError on anything else."""
    try:
        paths = [tuple(p) for p in (ast.literal_eval(spec) if isinstance(spec, str) else spec)]
    except (ValueError, SyntaxError, TypeError) as e:
        raise ValueError(f"speculative_token_tree {spec!r} is not a list of tuples of child ranks, such as "
                         "[(0,), (1,), (0, 0)]") from e
    index = {(): 0}
    parents = [-1]
    for path in paths:
        if not path or any(not isinstance(r, int) or r < 0 for r in path) or path in index:
            raise ValueError(f"speculative_token_tree: node {path} is not a new path of child ranks >= 0")
        if path[:-1] not in index or (path[-1] and path[:-1] + (path[-1] - 1,) not in index):
            raise ValueError(f"speculative_token_tree: node {path} comes before its parent or its elder "
                             "sibling; list the nodes breadth first, as vLLM does")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
    return parents


def child_ranks(parents: list[int]) -> list[int]:
    """Each node's rank among its siblings (0: its parent's first child); the root's is 0."""
    seen: dict[int, int] = {}
    ranks = [0]
    for p in parents[1:]:
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks


def sibling_proposal(q: torch.Tensor, earlier: list[int]) -> torch.Tensor:
    """The distribution a child was drawn from when drawn from q [V] without replacement after its
    earlier siblings' tokens: q without them, renormalized (what the child's q_j must be)."""
    q = q.double().clone()
    q[earlier] = 0.0
    return q / q.sum()


def renormalized(weights: torch.Tensor) -> torch.Tensor:
    """r_{j+1} from the weights max(r_j - q_j, 0) a rejection leaves: divided by their sum."""
    return weights / weights.sum(-1, keepdim=True)


def rerank(scores: list[float], parents: list[int], n: int) -> list[int]:
    """EAGLE-2's rerank: the n nodes (besides the root) of highest score, the product of draft
    probabilities along the path, in tree order. A child's score is at most its parent's, and ties go to
    the earlier node, so every chosen node's parent is chosen too: the result is a tree."""
    best = sorted(range(1, len(parents)), key=lambda i: (-scores[i], i))[:n]
    return [0, *sorted(best)]


def own_draws(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
              depth: torch.Tensor) -> torch.Tensor:
    """The target's own token after every node [B, N+1], from p [B, N+1, V]: what plain sampling draws at
    the node's position (positions [B]: the first draft's; depth [B, N+1]), with its EMIT noise."""
    batch, nodes, vocab = p.shape
    at = (positions[:, None] + depth).flatten()
    noise = uniform_noise(seeds.repeat_interleave(nodes), at, EMIT)
    return pick(p.reshape(-1, vocab), noise).view(batch, nodes)


def walk_ids(target_ids: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int):
    """Tree verification of deterministic candidates (a one-hot q: suffix continuations, a drafter's
    top-k, greedy drafts): from the root, emit the target's own token after the node, target_ids
    [B, N+1] (the argmax, or own_draws), and go down to the child that holds it, while one does. That
    is the rule above with one-hot q_j (a candidate is accepted with the target's probability of it,
    given the siblings rejected before it), coupled to plain sampling's draws: the output equals plain
    decoding's token for token, whatever the tree. tokens, parents as in tree_rejection_sample; returns
    what it returns."""
    batch = len(target_ids)
    rows = torch.arange(batch, device=target_ids.device)
    node = torch.zeros(batch, dtype=torch.long, device=target_ids.device)
    walking = torch.ones(batch, dtype=torch.bool, device=target_ids.device)
    out = torch.zeros(batch, max_depth + 1, dtype=torch.long, device=target_ids.device)
    path = torch.zeros(batch, max_depth, dtype=torch.long, device=target_ids.device)
    for depth in range(max_depth + 1):
        drawn = target_ids[rows, node]
        out[:, depth] = torch.where(walking, drawn, out[:, depth])
        if depth == max_depth:
            break
        match = (parents == node[:, None]) & (tokens == drawn[:, None])   # the child holding it, if any
        walking = walking & match.any(-1)
        node = torch.where(walking, match.long().argmax(-1), node)
        path[:, depth] = torch.where(walking, node, 0)
    return out, path, (path > 0).sum(-1)


def tree_rejection_sample(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                          q: torch.Tensor | None, seeds: torch.Tensor, positions: torch.Tensor,
                          max_depth: int, max_children: int):
    """Tree speculative sampling (above) for a batch, each request with its own tree.

    p          [B, N+1, V]  row i: the target's distribution of the token after node i's path
    tokens     [B, N+1]     the node's draft token (node 0: unused)
    parents    [B, N+1]     the parent list; -2 for padding past a request's own tree (never a parent)
    q          [B, N+1, V]  q_j of each node's token (node 0: unused); None where every candidate is
                            deterministic: walk_ids over own_draws
    positions  [B]          the position of the first draft token (the request's current length)
    max_depth, max_children: the trees' largest depth and branching (from the host: static shapes)
    Returns tokens [B, max_depth + 1], the accepted path's nodes [B, max_depth] (0-padded) and
    num_accepted [B]: request b's output is tokens[b, :num_accepted[b] + 1]."""
    if q is None:
        depth = depths_of(parents, max_depth)
        return walk_ids(own_draws(p, seeds, positions, depth), tokens, parents, max_depth)
    batch, _, vocab = p.shape
    rows = torch.arange(batch, device=p.device)
    earlier = torch.ones(parents.shape[1], parents.shape[1], device=p.device).tril(-1).bool()
    rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)   # [B, N+1]: child_ranks
    node = torch.zeros(batch, dtype=torch.long, device=p.device)
    walking = torch.ones(batch, dtype=torch.bool, device=p.device)
    out = torch.zeros(batch, max_depth + 1, dtype=torch.long, device=p.device)
    path = torch.zeros(batch, max_depth, dtype=torch.long, device=p.device)
    for depth in range(max_depth + 1):
        children = parents == node[:, None]                   # [B, N+1]: the current node's children
        drawn, accepted, child = try_children(p[rows, node], tokens, q, children, rank, seeds,
                                              positions + depth, walking, max_children)
        out[:, depth] = torch.where(walking, drawn, out[:, depth])
        if depth < max_depth:
            path[:, depth] = torch.where(accepted, child, 0)
        walking, node = accepted, torch.where(accepted, child, node)
    return out, path, (path > 0).sum(-1)


def depths_of(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Each node's depth [B, N+1] from parents [B, N+1] on the device (padding nodes: 0)."""
    depth = torch.zeros_like(parents)
    for _ in range(max_depth):
        depth = torch.where(parents >= 0, depth.gather(1, parents.clamp(min=0)) + 1, 0)
    return depth


def ancestors_of(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """ancestor_mask on the device for a batch: [B, N+1, N+1], True where j is i's ancestor or i itself."""
    nodes = parents.shape[1]
    eye = torch.eye(nodes, dtype=torch.bool, device=parents.device).expand(len(parents), -1, -1)
    mask = eye
    for _ in range(max_depth):
        up = mask.gather(1, parents.clamp(min=0)[:, :, None].expand(-1, -1, nodes))   # the parent's row
        mask = eye | (up & (parents >= 0)[:, :, None])
    return mask


def try_children(p: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor, children: torch.Tensor,
                 rank: torch.Tensor, seeds: torch.Tensor, at: torch.Tensor, walking: torch.Tensor,
                 max_children: int):
    """One node of each walking request, whose target distribution is p [B, V]: its children tried in rank
    order against the residual r. Returns the token the node emits [B] (the accepted child's, or a draw
    from the last residual), whether a child was accepted [B], and which [B]. With one child this is
    sampler.rejection_sample's step, noise and arithmetic alike (the draw is from the unnormalized
    max(p - q, 0), as there)."""
    batch = len(p)
    rows = torch.arange(batch, device=p.device)
    accepted = torch.zeros(batch, dtype=torch.bool, device=p.device)
    child = torch.zeros(batch, dtype=torch.long, device=p.device)
    r = weights = p   # r: the residual, normalized; weights: what a rejection leaves to draw from
    for j in range(max_children):
        is_j = children & (rank == j)
        trying = walking & ~accepted & is_j.any(-1)
        i = is_j.long().argmax(-1)
        x, q_j = tokens[rows, i], q[rows, i]
        u = uniform_noise(seeds, at, ACCEPT if j == 0 else SIBLING_STREAM + j)
        take = trying & (u < acceptance_probability(r[rows, x], q_j[rows, x]))
        accepted, child = accepted | take, torch.where(take, i, child)
        rejected = trying & ~take
        weights = torch.where(rejected[:, None], next_token_weights(r, q_j, rejected), weights)
        r = torch.where(rejected[:, None], renormalized(weights), r)
    drawn = pick(weights, uniform_noise(seeds, at, EMIT))
    return torch.where(accepted, tokens[rows, child], drawn), accepted, child
