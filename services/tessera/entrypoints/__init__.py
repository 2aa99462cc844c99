"""One module per process: worker, attention_node, expert_node, gateway/ (main.py starts it),
serve (worker + gateway, supervised), probe; flags.py turns the config dataclasses into the
flags cli.py parses."""
