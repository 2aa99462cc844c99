"""Tessera's kernels: each file holds a torch reference and the fast kernel beside it.
Never imports tessera (the runtime imports these, not the other way round)."""
