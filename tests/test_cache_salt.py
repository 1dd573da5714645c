"""Tenants apart (DESIGN invariant 8): requests with different cache salts share no cached item in any tier.

A salt is the request's `cache_salt` (vLLM's field) or, with `--cache-isolation per-key`, derived from the API key
the request authenticated with. The salt's key replaces the root of every chained content address
(cache/segments/segment.py, salt_key_of), and the radix tree keeps one root per salt, so the same prompt under
another salt (or none) matches nothing: cached_tokens 0 on the device, the host, the disk, after a restart from
disk, and through Redis; the same salt resumes as an unsalted request does, and an unsalted request's segment
keys are those of a build without salts (existing disk caches stay valid).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from cairn.cache.segments.segment import salt_key_of
from cairn.cache.tree.nodes import DISK, HOST, REMOTE
from cairn.config import EngineConfig, config_with_overrides
from cairn.engine.engine import Engine
from cairn.engine.llm import LLM
from cairn.request.sampling_params import SamplingParams
from cairn.server.app import create_app
from cairn.server.options import ServerOptions

OPTS = dict(kv_cache_gib=0.05, state_cache_gib=0.02, page_size=8, snapshot_interval=64, max_num_batched_tokens=96)
SLOT = 430_080  # bytes of one demo-model state slot
PROMPT = list(range(10, 150))  # 140 tokens: grid snapshots at 64 and 128, the prompt's end at 140
# the disk segment keys of PROMPT answered unsalted (4 greedy tokens), as the build before salts wrote them
UNSALTED_KEYS = ["0ce16fd3d0c5a19c4bc5b27e834d5bccd2907df9b43e70ff6ea4bb3c4ae1bc17",
                 "28dc8285f8522c477a526944d343af01c3d5800b95a59bdf5678e42cfa9cfc89",
                 "7c6979870631f4d0fdf3bed3675b9d7fb6279280a6c10b8093f5af8ddc3609a7",
                 "e2e0a59a766fc3cfab6e19c926e75ddadc70a47e15bc42d13205357d547a8507"]


def tiered(tmp_path=None, **kw) -> LLM:
    opts = dict(OPTS, device_snapshot_gib=40 * SLOT / 2**30, host_cache_gib=2 * 12 * SLOT / 2**30)
    if tmp_path is not None:
        opts["disk_cache"] = str(tmp_path)
    return LLM(**{**opts, **kw})


def ask(llm: LLM, prompt: list[int], salt: str | None):
    """The cache's report of one greedy answer under `salt`, the engine's bookkeeping checked after it."""
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt))[0]
    llm.engine.check_integrity()
    return out.cache


def disk_keys(llm: LLM) -> list[bytes]:
    return list(llm.engine.cache.tiers.by_name[DISK].store.keys())  # noqa: SIM118 (a store, not a dict)


def demote_all(llm: LLM, *tiers: str) -> None:
    """Move every snapshot the tree holds down through `tiers` (host, then disk)."""
    cache = llm.engine.cache
    for _, _, node in list(cache.tree.iter_snapshots()):
        for name in ("device", *tiers)[:-1]:
            if name in node.snapshot.handle.copies:
                cache.tiers.demote_snapshot(node, cache.tiers.by_name[name])


def test_another_salt_or_none_resumes_nothing_of_the_same_prompt_and_the_same_salt_resumes_it():
    llm = tiered()
    assert ask(llm, PROMPT, "alice").cached_tokens == 0
    for other in ("bob", None):  # nothing of alice's is matched: not a token of it
        report = ask(llm, PROMPT, other)
        assert (report.cached_tokens, report.match_length) == (0, 0)
    assert ask(llm, PROMPT, "carol").match_length == 0  # nor of the unsalted path now stored
    for salt in ("alice", None):
        report = ask(llm, PROMPT, salt)
        assert report.cached_tokens == len(PROMPT) and report.resume_tier == "device"
    assert set(llm.engine.cache.tree.roots) == {salt_key_of(s) for s in ("alice", "bob", "carol")}


def test_a_salt_resumes_nothing_of_anothers_snapshots_on_the_host():
    llm = tiered()
    ask(llm, PROMPT, "alice")
    demote_all(llm, HOST)
    assert ask(llm, PROMPT, "bob").cached_tokens == 0
    report = ask(llm, PROMPT, "alice")
    assert report.cached_tokens == len(PROMPT) and report.resume_tier == HOST


def test_a_salt_resumes_nothing_of_anothers_segments_on_disk(tmp_path):
    llm = tiered(tmp_path, disk_write_through=False)
    ask(llm, PROMPT, "alice")
    demote_all(llm, HOST, DISK)
    assert ask(llm, PROMPT, "bob").cached_tokens == 0
    report = ask(llm, PROMPT, "alice")
    assert report.cached_tokens == len(PROMPT) and report.resume_tier == DISK


def test_after_a_restart_from_disk_only_the_same_salt_resumes_and_the_salt_is_written_nowhere(tmp_path):
    with tiered(tmp_path) as first:
        ask(first, PROMPT, "alice")
    assert not any(b"alice" in f.read_bytes() for f in tmp_path.rglob("*") if f.is_file())
    with tiered(tmp_path) as second:
        assert set(second.engine.cache.tree.roots) == {salt_key_of("alice")}  # indexed under alice's root
        for other in ("bob", None):
            assert ask(second, PROMPT, other).cached_tokens == 0
        report = ask(second, PROMPT + [5], "alice")
        assert report.cached_tokens >= 128 and report.resume_tier == DISK


def test_an_unsalted_request_writes_the_segment_keys_it_wrote_before_salts_and_a_salted_one_none_of_them(tmp_path):
    with tiered(tmp_path / "plain") as plain, tiered(tmp_path / "salted") as salted:
        ask(plain, PROMPT, None)
        ask(salted, PROMPT, "alice")
        assert sorted(k.hex() for k in disk_keys(plain)) == UNSALTED_KEYS
        salted_keys = disk_keys(salted)
        assert len(salted_keys) == len(UNSALTED_KEYS) and not {k.hex() for k in salted_keys} & set(UNSALTED_KEYS)
        infos = [salted.engine.cache.tiers.by_name[DISK].store.info(k) for k in salted_keys]
        firsts = [info.parent_key for info in infos if info.start_position == 0]
        assert firsts == [salt_key_of("alice")]  # the chain hangs from the salt's key


def test_through_redis_another_replica_resumes_a_prompt_under_its_salt_only(redis_server):
    def replica() -> LLM:
        llm = LLM(**OPTS, remote_cache=redis_server.url)
        llm.engine.cache.tiers.by_name[REMOTE].store.redis.timeout_s = 5.0
        return llm

    with replica() as a, replica() as b:
        ask(a, PROMPT, "alice")
        assert a.engine.cache.tiers.by_name[REMOTE].store.flush()
        for other in ("bob", None):
            assert ask(b, PROMPT + [5], other).cached_tokens == 0
        report = ask(b, PROMPT + [5], "alice")
        assert report.resume_tier == REMOTE and report.cached_tokens >= len(PROMPT)
        probe = b.engine.cache.probe(PROMPT + [6], "dave")
        assert (probe.position, probe.remote_position) == (0, 0)


# ---- served: the request field and --cache-isolation per-key ----------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(config_with_overrides(EngineConfig(), kv_cache_gib=0.02, state_cache_gib=0.02, max_model_len=256,
                                        max_num_seqs=2))


def cached(client: TestClient, key: str | None = None, **fields) -> int:
    """cached_tokens of a completion of the prompt PROMPT[:40] (headers with API key `key`)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = client.post("/v1/completions", headers=headers, json={"model": "cairn-demo-random", "prompt": PROMPT[:40],
                                                               "max_tokens": 2, "ignore_eos": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_request_field_separates_and_a_probe_sees_the_same_namespace(engine):
    with TestClient(create_app(engine, ServerOptions())) as client:
        assert cached(client, cache_salt="s1") == 0
        assert cached(client, cache_salt="s2") == 0 and cached(client) == 0
        assert cached(client, cache_salt="s1") > 0
        probe = {"model": "cairn-demo-random", "prompt": PROMPT[:40]}
        assert client.post("/v1/cache/probe", json={**probe, "cache_salt": "s1"}).json()["position"] > 0
        assert client.post("/v1/cache/probe", json={**probe, "cache_salt": "s3"}).json()["position"] == 0


def test_per_key_isolation_keeps_two_api_keys_apart_and_the_same_key_resumes(engine):
    options = ServerOptions(api_key="key-one,key-two", cache_isolation="per-key")
    with TestClient(create_app(engine, options)) as client:
        assert cached(client, "key-one") == 0
        assert cached(client, "key-two") == 0  # the same prompt, another key: nothing reused
        assert cached(client, "key-two", cache_salt="x") == 0  # a salt of its own inside the key's namespace
        assert cached(client, "key-one") > 0 and cached(client, "key-two") > 0


CHAT = {"model": "cairn-demo-random", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "cairn-demo-random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": {"model": "cairn-demo-random", "prompt": "hi"},
          "/v1/responses": {"model": "cairn-demo-random", "input": "hi"}, "/v1/messages": MESSAGES,
          "/v1/cache/probe": CHAT, "/v1/cache/probe/messages": MESSAGES,
          "/v1/cache/probe/responses": {"model": "cairn-demo-random", "input": "hi"}}


def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400_naming_it_on_every_route(engine):
    with TestClient(create_app(engine, ServerOptions())) as client:
        for path, body in BODIES.items():
            for salt in (7, "", ["a"]):
                r = client.post(path, json={**body, "cache_salt": salt})
                assert r.status_code == 400 and "cache_salt" in r.text, (path, salt, r.text)


def test_per_key_isolation_is_refused_without_an_api_key():
    from cairn.config import ConfigError

    with pytest.raises(ConfigError, match="--cache-isolation per-key"):
        ServerOptions(cache_isolation="per-key")
