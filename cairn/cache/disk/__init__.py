"""The disk tier: segment format, store, namespace directory, tier, index and the offline `cairn cache` tools."""
