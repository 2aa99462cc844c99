"""The acceptance rule of tree verification (docs/design/speculative.md#acceptance), apart from
any tensor code."""
from __future__ import annotations

from typing import Callable

from tessera.spec.tree import Draft


def accept(draft: Draft, draw: Callable[[int], int | None]) -> list[int]:
    """Walk the verified tree from its root and return the accepted nodes (1-based ids).

    At node n (0 = the root) `draw(n)` emits the target's own token for the position after n:
    a draw from the target's distribution there, warped and seeded exactly as plain decoding
    warps and seeds it (greedy: its argmax), or None when that token finished the request.
    If a child of n carries the token, the child is accepted and the walk continues there;
    otherwise the token is the round's last. Every emitted token is thus a draw from the target
    conditioned on the tokens before it, so the output equals target-only decoding exactly
    (greedy: token for token; seeded: draw for draw; else in distribution) for any draft tree
    built without sampling, and every round emits at least one token.
    """
    children = draft.children()
    node, path = 0, []
    while True:
        token = draw(node)
        if token is None:
            return path
        node = children[node].get(token, -1)
        if node < 0:
            return path
        path.append(node)
