"""The remote tier: disk-format segments in a shared Redis / Valkey, so replicas resume each other's conversations.

keys.py (Redis key names, index entries, canonical prefix keys), client.py (URL forms, timeouts, the
circuit breaker), writer.py (the write-behind thread and its bounded queue), store.py
(RedisSegmentStore: DiskStore's interface over Redis) with record.py (KnownSegments: the segments it knows
Redis to hold), epoch.py (Epoch: whether Redis lost what was written before) and chains.py (ChainLookup: a
prompt's deepest stored chain), tier.py (RemoteTier: the disk tier's logic over
that store, plus lookup by prompt), lookups.py (RemoteLookups: those lookups on threads of their own, so
the engine thread never waits on Redis), finder.py (RemoteFinder: the cache's use of them, starting
lookups and hanging their answers on the tree). The cache puts the tier last in its tier list
(cache/factory.py).
"""
