"""The disk tier's store: segment files in a namespace directory (store.py, its lock, space, index and entries) and
the offline `cairn cache` tools. The segment format and the tier over the store are cairn/cache/segments/."""
