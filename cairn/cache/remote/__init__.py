"""The remote tier: disk-format segments in a shared Redis / Valkey, so replicas resume each other's conversations.

keys.py (Redis key names, index entries, canonical prefix keys), client.py (URL forms, timeouts, the
circuit breaker), writer.py (the write-behind thread and its bounded queue), store.py (RedisSegmentStore: a
SegmentStore, cache/segments/store.py, over Redis) with record.py (KnownSegments: the segments it knows Redis to
hold), epoch.py (Epoch: whether Redis lost what was written before) and chains.py (ChainLookup: a
prompt's deepest stored chain), lookups.py (RemoteLookups: lookups by prompt on threads of their own, so
the engine thread never waits on Redis), finder.py (lookup: a prompt's stored chain, as the tier's index hangs
it; RemoteFinder: the cache's use of the lookups, starting them and hanging their answers on the tree). The
tier over the store is the disk tier's (cache/segments/tier.py: a SegmentTier named REMOTE), which the factory
puts last in its tier list (cache/factory.py).
"""
