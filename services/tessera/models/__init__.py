"""Model architectures (one file each) and the checkpoint loader."""
