"""The hybrid prefix cache: the radix tree (tree/), snapshot placement, retention and the resume planner (policy/),
the device and host tiers (tiers/), the segment tiers (segments/: one SegmentTier over a store, disk/ or remote/
(Redis)), and the cache the scheduler calls (hybrid.py, behind base.py's PrefixCache)."""
