"""Disaggregated speculative decoding (SwiftSpec): draft trees, the evolving tree cache,
tree verification in the target engine, and the draft worker's asynchronous expansion."""
