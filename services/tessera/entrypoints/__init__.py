"""One module per process kind: worker, gateway/ (and later attention_node, expert_node, ...)."""
