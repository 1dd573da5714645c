"""Building blocks of hybrid models: norms, rotary embedding, gated attention, the recurrent mixers (Gated
DeltaNet, Mamba2: one interface, cairn.layers.recurrent), MLP/MoE. Each takes its own small spec dataclass,
never the model's config."""
