"""The model itself: the transformer built from a ModelSpec, its layers, attention, MoE blocks and
how a routed batch of experts is computed."""
