"""The draft token tree of SwiftSpec (docs/design/speculative.md#token-tree): plain Python, no
torch.

Node 0 is the root: the request's last verified token, whose target KV is not computed yet.
Every other node is a draft guess hanging under its parent, weighted by the log-probability
of its whole path from the root under the draft model. A node is *expanded* once the draft
model has run its token (its KV is in the draft's tree cache and its children exist).
Because a child's weight is never above its parent's, the heaviest nodes form an
ancestor-closed subtree: that is the subtree sent to the target (`best`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence


def lineage(parents: Sequence[int], node: int) -> list[int]:
    """`node` and its ancestors up to the root (parents[root] == -1): the rows a tree node's
    attention mask opens, in the target's tree chunk and in the draft's tree cache alike."""
    out = []
    while node != -1:
        out.append(node)
        node = parents[node]
    return out


@dataclass(frozen=True)
class Draft:
    """A subtree to verify. The root (the request's last token) is implicit: tokens[i] hangs
    under parents[i], where 0 is the root and j > 0 is tokens[j - 1]; parents come first."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft needs one parent per token")
        if any(not 0 <= p <= i for i, p in enumerate(self.parents)):
            raise ValueError("every draft parent must come before its child")

    def __len__(self) -> int:
        return len(self.tokens)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless every token is an id in [0, vocab_size): the verifier's
        embedding would fail the whole step on one outside it (a negative id included)."""
        if any(not 0 <= t < vocab_size for t in self.tokens):
            raise ValueError(f"a draft token is outside the vocabulary of {vocab_size}")

    def depths(self) -> list[int]:
        """Depth of the root and of every token (root 0): RoPE positions are prefix + depth."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth

    def children(self) -> list[dict[int, int]]:
        """children()[node] maps a token to the node (1-based, 0 = root) that carries it."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            kids[p].setdefault(t, i + 1)
        return kids


@dataclass
class TokenTree:
    """Nodes in creation order (a parent always before its children)."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    weights: list[float] = field(default_factory=lambda: [0.0])
    depths: list[int] = field(default_factory=lambda: [0])
    expanded: list[bool] = field(default_factory=lambda: [False])
    kids: list[dict[int, int]] = field(default_factory=lambda: [{}])
    _leaves: list[tuple[float, int, int]] = field(default_factory=lambda: [(-0.0, 0, 0)])

    @classmethod
    def rooted_at(cls, token: int) -> "TokenTree":
        return cls([token])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, logprob: float) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.weights.append(self.weights[parent] + logprob)
        self.depths.append(self.depths[parent] + 1)
        self.expanded.append(False)
        self.kids.append({})
        self.kids[parent][token] = node
        heapq.heappush(self._leaves, (-self.weights[node], self.depths[node], node))
        return node

    def frontier(self, width: int) -> list[int]:
        """Pop the `width` most probable unexpanded nodes (ancestors first on ties)."""
        out = []
        while self._leaves and len(out) < width:
            out.append(heapq.heappop(self._leaves)[2])
        return sorted(out)

    def best(self, size: int) -> list[int]:
        """The `size` most probable nodes, root included, in creation order: ancestor-closed
        because weights never rise along a path and ties go to the shallower node."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.weights[n], self.depths[n], n))
        return sorted(order[:size])

    def walk(self, tokens: list[int]) -> list[int]:
        """The nodes along `tokens` from the root (root first), as far as the tree has them."""
        path = [0]
        for t in tokens:
            nxt = self.kids[path[-1]].get(t)
            if nxt is None:
                break
            path.append(nxt)
        return path

    def subtree(self, root: int) -> list[int]:
        """`root` and all its descendants, in creation order."""
        inside = {root}
        for n in range(root + 1, len(self.tokens)):
            if self.parents[n] in inside:
                inside.add(n)
        return sorted(inside)

    def draft(self, nodes: list[int]) -> Draft:
        """`nodes` (ancestor-closed, containing the root, in creation order) as a Draft."""
        index = {n: i for i, n in enumerate(nodes)}
        rest = [n for n in nodes if n != 0]
        return Draft(tuple(self.tokens[n] for n in rest), tuple(index[self.parents[n]] for n in rest))

    def reroot(self, root: int) -> tuple["TokenTree", list[int]]:
        """The subtree under `root` as a tree of its own (weights and depths relative to it)
        and the old id of each new node."""
        old = self.subtree(root)
        new = TokenTree.rooted_at(self.tokens[root])
        new._leaves = []
        index = {root: 0}
        for n in old[1:]:
            index[n] = new.add(index[self.parents[n]], self.tokens[n],
                               self.weights[n] - self.weights[self.parents[n]])
        new.expanded = [self.expanded[n] for n in old]
        new._leaves = [(w, d, n) for (w, d, n) in new._leaves if not new.expanded[n]]
        if not new.expanded[0]:
            new._leaves.append((-0.0, 0, 0))
        heapq.heapify(new._leaves)
        return new, old
