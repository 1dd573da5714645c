"""The radix tree: token paths, their KV pages per tier and their snapshots (torch-free)."""
