"""One request's draft model state: the evolving tree cache of SwiftSpec
(docs/design/speculative.md#evolving-tree-cache).

The draft's KV cache is one contiguous run of slots per layer, `[verified prefix | tree]`:
slots [0, P) hold the verified tokens in order, slots P.. the expanded tree nodes in the order
they were expanded. Expanding w leaves is one forward through the shared layer driver, each
leaf attending to the prefix and to its own ancestors only (a non-square mask) at position
P + depth; the paged kernel runs every row over the slots of its mask row (one-slot blocks).
A verification result re-roots the tree: the verified path moves into the prefix and the
surviving subtree is compacted behind it by one gather per layer, with no recomputation;
tokens the tree did not hold are forwarded on the next expansion.
A slot's KV depends on its token, ancestors and position, not on where it is stored, so
moving it is exact.
"""
from __future__ import annotations

import torch

from tessera.batch import ForwardBatch, PrefillChunk
from tessera.models.driver import run_layers
from tessera.models.llama import CausalLM
from tessera.spec.tree import Draft, TokenTree, lineage


class TreeDrafter:
    """Draft state of one request. `layers` picks the layers to run (a self-draft runs the
    target's first K); the final norm and head are the model's own."""

    def __init__(self, model: CausalLM, layers: range, max_len: int, width: int, branching: int = 4) -> None:
        self.model, self.layers, self.width, self.branching = model, layers, width, branching
        self.capacity = max_len           # slots it may grow to; allocated as needed (_reserve)
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * model.config.num_layers
        self._reserve(256)
        self.prefix = 0                 # P: verified tokens whose KV is in slots [0, P)
        self.pending: list[int] = []    # verified tokens still to forward (after a miss)
        self.tree = TokenTree.rooted_at(0)
        self.slot: dict[int, int] = {}  # expanded tree node -> its slot (>= P)
        self.wasted = 0                 # expanded nodes dropped by re-roots (the draft's wasted work)

    def start(self, token_ids: list[int]) -> None:
        """A new request: everything but the last token is verified context, the last the root."""
        self.prefix, self.pending, self.slot = 0, list(token_ids[:-1]), {}
        self.tree = TokenTree.rooted_at(token_ids[-1])

    @property
    def used(self) -> int:
        return self.prefix + len(self.pending) + len(self.slot)

    @torch.inference_mode()
    def expand(self) -> int:
        """One draft forward over the `width` most probable unexpanded nodes; their top
        `branching` children join the tree. Verified tokens still pending (after a miss) ride in
        the same forward ahead of them. Returns how many nodes were expanded (0: cache full)."""
        pending, p = self.pending, self.prefix
        last = self.model.config.max_position_embeddings - 1 - p - len(pending)   # RoPE's table ends
        leaves = [n for n in self.tree.frontier(self.width) if self.tree.depths[n] <= last]
        leaves = leaves[:max(self.capacity - self.used, 0)]
        if not leaves:
            return 0
        start = p + len(self.slot)            # pending is non-empty only when no node has a slot
        base = start + len(pending)
        self._reserve(base + len(leaves))
        for i, n in enumerate(leaves):
            self.slot[n] = base + i
        q = len(pending)
        mask = torch.zeros(q + len(leaves), base + len(leaves), dtype=torch.bool)
        mask[:q, :p + q] = torch.arange(p + q)[None, :] <= torch.arange(p, p + q)[:, None]
        mask[q:, :p + q] = True
        for i, n in enumerate(leaves):
            mask[q + i, [self.slot[a] for a in lineage(self.tree.parents, n)]] = True
        positions = list(range(p, p + q)) + [p + q + self.tree.depths[n] for n in leaves]
        tokens = pending + [self.tree.tokens[n] for n in leaves]
        logits = self._forward(tokens, start, positions, mask, skip=q)
        self.prefix, self.pending = p + q, []
        top = torch.log_softmax(logits, dim=-1).topk(self.branching, dim=-1)
        for i, n in enumerate(leaves):
            self.tree.expanded[n] = True
            for lp, t in zip(top.values[i].tolist(), top.indices[i].tolist()):
                self.tree.add(n, t, lp)
        return len(leaves)

    def draft(self, size: int) -> Draft:
        """The most probable ancestor-closed subtree of `size` nodes, root included."""
        return self.tree.draft(self.tree.best(size))

    @torch.inference_mode()     # the caches may have been grown (allocated) in inference mode
    def reroot(self, emitted: list[int]) -> bool:
        """The target emitted `emitted` after the root (accepted tokens, then its own):
        the root and all but the last emitted token become verified prefix, the last the new
        root. Returns True on a hit (the new root was in the tree and its subtree survives)."""
        path = self.tree.walk(emitted)
        verified = [self.tree.tokens[0]] + emitted[:-1]
        kept = 0                        # verified tokens whose KV the tree already holds, in order
        while kept < len(verified) and kept < len(path) and path[kept] in self.slot and not self.pending:
            kept += 1
        hit = kept == len(verified) and len(path) == len(emitted) + 1
        if hit:
            tree, old_ids = self.tree.reroot(path[-1])
            survivors = [(new, old) for new, old in enumerate(old_ids) if old in self.slot]
        else:
            tree, survivors = TokenTree.rooted_at(emitted[-1]), []
        moved = [self.slot[n] for n in path[:kept]] + [self.slot[old] for _, old in survivors]
        self.wasted += len(self.slot) - len(moved)
        self._gather(self.prefix, moved)      # pending is empty whenever anything moves
        self.prefix += kept
        self.pending += verified[kept:]
        self.slot = {new: self.prefix + i for i, (new, _) in enumerate(survivors)}
        self.tree = tree
        return hit

    def _reserve(self, slots: int) -> None:
        """Grow every layer's cache to hold `slots` (doubling, up to capacity): a long context's
        draft KV is paid for only by requests that reach it."""
        have = 0 if self.kv[self.layers[0]] is None else self.kv[self.layers[0]][0].shape[1]
        if slots <= have:
            return
        cfg = self.model.config
        size = min(max(slots, 2 * have), self.capacity)
        dtype = self.model.embed_tokens.weight.dtype
        for l in self.layers:
            new = tuple(torch.zeros(cfg.num_kv_heads, size, cfg.head_dim, dtype=dtype) for _ in range(2))
            if self.kv[l] is not None:
                for old, grown in zip(self.kv[l], new):
                    grown[:, :have] = old
            self.kv[l] = new

    def _gather(self, dst: int, src: list[int]) -> None:
        """Move the KV of slots `src` to dst, dst + 1, ... in every layer (one gather each)."""
        if not src or src == list(range(dst, dst + len(src))):
            return
        idx = torch.tensor(src)
        for kv in self.kv:
            if kv is not None:
                for cache in kv:
                    cache[:, dst:dst + len(src)] = cache[:, idx]

    def _forward(self, tokens: list[int], start: int, positions: list[int], mask: torch.Tensor,
                 skip: int = 0) -> torch.Tensor:
        """Run `tokens` into slots start.. with explicit positions and mask over slots [0, start + n);
        logits of all but the first `skip` (a long prompt's rows never reach the head)."""
        n = len(tokens)
        slots = torch.arange(start, start + n)
        empty = torch.zeros(0, dtype=torch.long)
        # every row's slots, for the paged kernel (one-slot blocks): the True columns of its mask
        # row, ascending (a stable sort puts them first), and how many there are
        lens = mask.sum(dim=1)
        slots_of = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :int(lens.max())].contiguous()
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens), positions=torch.tensor(positions), slot_mapping=slots,
            decode_token_idx=empty, decode_block_tables=empty.view(0, 0), decode_context_lens=empty,
            decode_mask=torch.zeros(0, 0, dtype=torch.bool),
            prefills=[PrefillChunk(0, n, start, torch.arange(start + n), mask, row_slots=slots_of, row_lens=lens)],
            logits_idx=torch.arange(n), block_size=1)
        x = run_layers(self.model, self.model.embed_tokens(batch.input_ids), batch, self.kv, self.layers)
        return self.model.compute_logits(self.model.norm(x[skip:]))
