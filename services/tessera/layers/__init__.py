"""Building blocks shared by every architecture: norm, rope, attention, MoE."""
