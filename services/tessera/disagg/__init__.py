"""Attention-FFN disaggregation (MegaScale-Infer): the attention side runs attention, norms and
the router; expert shards hold slices of every layer's FFN; they talk over an M2N Transport."""
