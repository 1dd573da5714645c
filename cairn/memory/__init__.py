"""Memory: the paged KV pool (kv_pool), page bookkeeping (pages, torch-free) and state slots (state_pool).

Import from the submodules; this package file imports nothing, so torch-free users of `pages` do not
load torch.
"""
