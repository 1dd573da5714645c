"""Building blocks of hybrid models: norms, rotary embedding, gated attention, Gated DeltaNet, MLP/MoE."""
