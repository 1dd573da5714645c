"""Storage tiers: the device and host pools and the tier set that moves items between tiers."""
