"""The hybrid prefix cache: radix tree, snapshot placement and retention, planning, tiers."""
