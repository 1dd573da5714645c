"""What the segment tiers (disk, Redis) share: the segment format (segment.py: layout, keys, encode; decode.py:
reading one back, every check; named_bytes.py: the snapshot section's named tensors), SegmentInfo (store.py), the
read pins of a store (pins.py), the tier over a store of segments (tier.py) and the radix tree's record of a tier's
segments (index.py). The stores themselves are not here: cairn/cache/disk/ (files) and cairn/cache/remote/ (Redis)."""
