"""The trained demo model: the corpus it learns from, its training, and the checkpoint shipped with cairn.

`python -m cairn.demo.train` trains a small Qwen3.5-architecture model (Gated DeltaNet and gated
attention, with an MTP head) on this machine's CPU from a seed, with transformers' own Qwen3.5
classes, and writes an ordinary Hugging Face checkpoint directory. cairn ships the result in
`cairn/demo/checkpoint/` and serves it when no `--model` is given; docs/demo-model.md says what it
learnt from and how well it does. cairn's own model code stays inference-only: nothing here is
imported when serving.
"""
