"""The models: one file per family (qwen3_5, qwen3_5_moe, qwen3_next, nemotron_h, granitemoehybrid, falcon_h1) over
the shared hybrid stack (hybrid.py), the family table (families.py: which file serves which `model_type`), the
config read once from a checkpoint (config.py), the loader (loader.py: weights into the model, the weight layouts
of layout.py) and the decode plan (decode_plan.py: a bf16 decode step through pre-bound calls). Not here: the
layers they are built of (cairn/layers/) and the kernels (cairn/ops/)."""
