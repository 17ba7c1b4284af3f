"""Draft trees: a chain with a mask and a parent list.

A request's tree hangs below its last token, node 0 (the root). Nodes 1 .. N are drafts; node i has a
parent parents[i] < i (a parent comes before its children) and a depth (its distance from the root);
siblings are tried in node order. A chain of K drafts is the tree parents = [-1, 0, 1, .., K - 1].
Verified in one target forward, node i is written to the cache slot num_cached + i, sits at the position
num_cached + depth[i], and sees the context and its own ancestors (`ancestors_of`). After the step the
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

Every tree the engine verifies has deterministic candidates (a drafter's top-k, suffix continuations,
a static tree's drafts): verify_tree walks them with walk_ids, the rule above for one-hot q_j.
tree_rejection_sample is the rule for any q_j, sampled candidates too; the tests check it against
the exact distribution.
"""
from __future__ import annotations

import ast
from collections import Counter

import torch
import torch.nn.functional as F

from nanospec.kv_cache import SINK_BLOCK, ragged_metadata
from nanospec.sampler import (ACCEPT, EMIT, acceptance_probability, next_token_weights, pick, target_probs,
                              uniform_noise)
from nanospec.triton_attention import TREE_NODES

MAX_NODES = TREE_NODES - 1   # a tree's drafts at most: with its root they fit the GPU kernel's mask bits
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


def tree_shape(trees: list[list[int]]) -> tuple[int, int]:
    """The largest depth and the most children of a node over the trees' parent lists."""
    return (max(max(depths(ps)) for ps in trees),
            max(max(Counter(ps[1:]).values(), default=0) for ps in trees))


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
        raise ValueError(f"{spec!r} is not a list of tuples of child ranks, such as "
                         "[(0,), (1,), (0, 0)]") from e
    index = {(): 0}
    parents = [-1]
    for path in paths:
        if not path or any(not isinstance(r, int) or r < 0 for r in path) or path in index:
            raise ValueError(f"node {path} is not a new path of child ranks >= 0")
        if path[:-1] not in index or (path[-1] and path[:-1] + (path[-1] - 1,) not in index):
            raise ValueError(f"node {path} comes before its parent or its elder "
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
    """[B, N+1, N+1] on the device: True where node j is node i's ancestor or i itself (what i attends to)."""
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


def mask_tree(meta, parents: torch.Tensor, cached: torch.Tensor, real_offsets: torch.Tensor,
              depth_bound: int) -> torch.Tensor:
    """A verify step's tree mask on the target's metadata: row b's query i (its node real_offsets[b, i],
    [B, K + 1]; node j's slot is cached[b] + j) sees the context and its node's ancestors. Returns the
    queries' positions for the rotary embedding [T]: cached + the node's depth."""
    nodes = real_offsets[..., None].expand(-1, -1, parents.shape[1])
    meta.tree = cached, ancestors_of(parents, depth_bound).gather(1, nodes)
    row = meta.token_seq
    meta.rotary = cached[row] + depths_of(parents, depth_bound)[row, meta.positions - cached[row]]
    return meta.rotary


def verify_tree(logits: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, sampling, mode,
                positions: torch.Tensor, depth_bound: int):
    """A tree step's acceptance (walk_ids) from the target's logits at every node [B, K + 1, V], each
    node's token [B, K + 1] and the parent lists: the target's own token at each node (its argmax, or
    own_draws under the rows' temperature, top-k and top-p; `mode`: "greedy" or the truncation).
    Returns tokens [B, K + 1] and the accepted path [B, K] (zeros past the walk), num_accepted [B]."""
    if mode == "greedy":
        target_ids = logits.argmax(-1)
    else:
        per_node = (x.repeat_interleave(nodes.shape[1]) for x in (sampling.temperature, sampling.top_k,
                                                                  sampling.top_p))
        p = target_probs(logits.flatten(0, 1), *per_node, mode).view(logits.shape)
        target_ids = own_draws(p, sampling.seeds, positions, depths_of(parents, depth_bound))
    tokens, path, num_accepted = walk_ids(target_ids, nodes, parents, depth_bound)
    pad = nodes.shape[1] - 1 - depth_bound
    return F.pad(tokens, (0, pad)), F.pad(path, (0, pad)), num_accepted


def follow_paths(kv_cache, requests, paths: list[list[int]], logits: torch.Tensor | None,
                 features: torch.Tensor | None, q_len: int):
    """After a tree step: each request's accepted path moved in place in the cache (path_moves: node j's
    K/V, at the slot num_cached + j, to num_cached + its depth); returns the step's logits [B, q_len, V]
    and EAGLE's features [B * q_len, F], if any, with each row's queries in path order (what the logprobs
    and the head read)."""
    size, moves = kv_cache.block_size, []
    for req, path in zip(requests, paths):
        slot = lambda offset, r=req: (r.block_table[(r.num_cached + offset) // size] * size   # noqa: E731
                                      + (r.num_cached + offset) % size)
        moves += [(slot(src), slot(dst)) for src, dst in path_moves(path)]
    if moves:
        kv_cache.move_slots(*zip(*moves))
    device = kv_cache.pool.device
    order = torch.tensor([[0, *p] + [0] * (q_len - 1 - len(p)) for p in paths], device=device)
    if features is not None:   # request b's rows b * q_len ...
        features = features[(torch.arange(len(paths), device=device)[:, None] * q_len + order).flatten()]
    if logits is not None:
        logits = logits[:len(paths)].gather(1, order[..., None].expand(-1, -1, logits.shape[-1]))
    return logits, features


def root_children(logits: torch.Tensor, topk: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth 1 of EAGLE-2's tree from the drafter's catch-up logits [R, V]: the root's topk children,
    their log-probabilities (a candidate's score) and tokens [R, topk]."""
    return F.log_softmax(logits.float(), -1)[:, :vocab].topk(topk, -1)


def grow_tree(drafter, tables: torch.Tensor, first_position: torch.Tensor, roots: list[torch.Tensor],
              hidden: torch.Tensor | None, budget: torch.Tensor, nodes: int, vocab: int):
    """EAGLE-2's dynamic tree for R rows of a model drafter (its .tree = (topk, steps), .next_step and
    .kv_cache), after its catch-up step (roots: its root_children; hidden [R, H] its carried state or
    None): a candidate's score is the sum of the drafter's log-probabilities along its path. Each step
    after the first feeds the `topk` best candidates of the last depth (the frontier) through
    next_step(meta, ids, hidden) -> (logits, hidden) and adds each one's top-k children among the first
    `vocab` ids; `steps` depths in all, and no more than `nodes`. Then the best budget[r] candidates
    (rerank; at most `nodes`) are row r's tree: a child scores at most its parent (ties: the earlier
    candidate), so every chosen node's parent is chosen too. Shapes are fixed by those host numbers, so
    nothing syncs: the body of a CUDA graph. A row whose first_position is 0 is not in the round (a
    padding row, a request that drafts nothing): it feeds position 0 into the sink block, and has no nodes.

    The frontier at depth d is written to the drafter's slots first_position + (d - 1) * topk + j at the
    position first_position + d - 1, seeing its context and its ancestors (the tree mask). Returns the
    tree's tokens [R, N] and parents [R, N + 1] (N = min(nodes, candidates); -2 past a row's own), nodes
    best first (so parents first, and a budget of n nodes keeps a tree's first n), and whether every row's
    draft logits were finite [R] (an idle row's are not read: True). Candidates are deterministic
    (top-k), so verification is walk_ids."""
    (scores, tokens), (topk, steps), block_size = roots, drafter.tree, drafter.kv_cache.block_size
    rows, device, active = len(first_position), first_position.device, first_position > 0
    steps = min(steps, nodes)
    cand_scores, cand_tokens = [scores], [tokens]
    cand_parents = [torch.full((rows, topk), -1, device=device)]   # a candidate's parent candidate (-1: root)
    frontier = torch.arange(topk, device=device).expand(rows, -1)   # candidate indices, depth d
    parent_fed = torch.full((rows, topk), -1, device=device)        # the frontier's parents' fed slots
    fed = torch.zeros(rows, topk * (steps - 1), topk * (steps - 1), dtype=torch.bool, device=device)
    # an idle row starts from zeros (iterating its own output could overflow) and has no nodes
    carried = None if hidden is None else torch.where(active[:, None], hidden, 0).repeat_interleave(topk, 0)
    flat_scores, flat_tokens, budget = scores, tokens, torch.where(active, budget, 0)
    finite = torch.ones(rows, dtype=torch.bool, device=device)
    each = lambda x: x.repeat_interleave(topk, 0)   # noqa: E731   (each frontier node a sequence of its own)
    base, sink = each(torch.where(active, first_position, 0)), ~each(active)
    for depth in range(1, steps):
        start = (depth - 1) * topk   # the frontier's fed slots: start .. start + topk - 1
        here = torch.arange(start, start + topk, device=device)
        above = fed.gather(1, parent_fed.clamp(min=0)[..., None].expand(-1, -1, fed.shape[2]))
        fed[:, start:start + topk] = (above & (parent_fed >= 0)[..., None]) | (
            torch.arange(fed.shape[2], device=device) == here[:, None])
        # a drafter's step reads its sequences' last queries
        slots = base + start + torch.arange(topk, device=device).repeat(rows)
        meta = ragged_metadata(each(tables), slots, torch.ones_like(slots), rows * topk, 1, block_size)
        meta.slot_mapping = torch.where(sink, SINK_BLOCK * block_size + meta.slot_mapping % block_size,
                                        meta.slot_mapping)
        meta.tree = base, fed[:, start:start + topk, :start + topk].flatten(0, 1)[:, None]
        meta.rotary = base + depth - 1
        ids = flat_tokens.gather(1, frontier)
        logits, carried = drafter.next_step(meta, ids.flatten(), carried)
        finite &= (logits.amax(-1).isfinite() | sink).view(rows, topk).all(-1)
        child_scores, child_tokens = root_children(logits, topk, vocab)
        child_scores = flat_scores.gather(1, frontier)[..., None] + child_scores.view(rows, topk, topk)
        offset = sum(s.shape[1] for s in cand_scores)
        cand_scores.append(child_scores.flatten(1))
        cand_tokens.append(child_tokens.view(rows, topk * topk))
        cand_parents.append(frontier.repeat_interleave(topk, 1))
        flat_scores, flat_tokens = torch.cat(cand_scores, 1), torch.cat(cand_tokens, 1)
        best = cand_scores[-1].topk(topk, -1).indices   # the next frontier, among the new candidates
        frontier, parent_fed = offset + best, start + best // topk
        if carried is not None:
            carried = carried.view(rows, topk, -1).gather(1, (best // topk)[..., None].expand(
                -1, -1, carried.shape[-1])).flatten(0, 1)
    return *rerank(flat_scores, flat_tokens, torch.cat(cand_parents, 1), budget, nodes), finite


def rerank(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, budget: torch.Tensor,
           nodes: int):
    """The best budget[r] (<= nodes) of each row's candidates (scores, tokens, parent candidate [R, C];
    -1: the root) as a tree: tokens [R, N] and parents [R, N + 1], N = min(nodes, C), node i + 1 the
    row's i-th best candidate (see grow_tree)."""
    rows, count = scores.shape
    n = min(nodes, count)
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(count, device=scores.device).expand(rows, -1)
    rank = torch.empty_like(order).scatter_(1, order, ranks)
    chosen = rank < budget[:, None]
    node = (rank + 1) * chosen   # a chosen candidate's node (1 ..), 0 otherwise
    parent_node = torch.where(parents >= 0, node.gather(1, parents.clamp(min=0)), 0)
    slot = torch.where(chosen, rank, n)    # unchosen: past the end, dropped
    out_tokens = torch.zeros(rows, n + 1, dtype=tokens.dtype, device=tokens.device).scatter_(1, slot, tokens)
    out_parents = torch.full((rows, n + 2), -2, dtype=torch.long, device=tokens.device).scatter_(
        1, slot + 1, parent_node)
    out_parents[:, 0] = -1
    return out_tokens[:, :n], out_parents[:, :n + 1]
