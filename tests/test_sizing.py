"""Memory budgets left to cairn: the host tier sized from RAM, demo-sized pools, --device-memory-fraction."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from cairn.config import GIB, EngineConfig, config_with_overrides
from cairn.engine import sizing
from cairn.engine.llm import LLM
from cairn.engine.sizing import CHECKPOINT_DEFAULTS, DEMO_DEFAULTS, default_host_gib, resolve_sizes

CPU = torch.device("cpu")


def test_host_tier_defaults_to_a_quarter_of_available_ram_capped_at_8_gib():
    assert default_host_gib(CHECKPOINT_DEFAULTS.host_cap_gib, 16 * GIB) == 4.0
    assert default_host_gib(CHECKPOINT_DEFAULTS.host_cap_gib, 64 * GIB) == 8.0
    assert default_host_gib(DEMO_DEFAULTS.host_cap_gib, 64 * GIB) == 0.25


def test_left_out_budgets_are_resolved_and_logged_given_ones_are_kept(caplog):
    with caplog.at_level(logging.INFO, logger="cairn.sizing"):
        checkpoint = resolve_sizes(EngineConfig(), CPU, is_demo=False)
        demo = resolve_sizes(config_with_overrides(EngineConfig(), kv_cache_gib=0.5), CPU, is_demo=True)
    assert checkpoint.memory.kv_cache_gib == 1.0 and checkpoint.cache.device_snapshot_gib == 1.0
    assert 0 < checkpoint.cache.host_cache_gib <= 8.0
    assert demo.memory.kv_cache_gib == 0.5  # given
    assert demo.memory.state_cache_gib == DEMO_DEFAULTS.state_cache_gib
    assert demo.cache.device_snapshot_gib == DEMO_DEFAULTS.device_snapshot_gib
    assert 0 < demo.cache.host_cache_gib <= 0.25
    assert "host tier" in caplog.text and "available RAM" in caplog.text


def test_host_cache_gib_zero_turns_the_host_tier_off():
    resolved = resolve_sizes(config_with_overrides(EngineConfig(), host_cache_gib=0), CPU, is_demo=False)
    assert resolved.cache.host_cache_gib == 0
    with LLM(host_cache_gib=0) as llm:
        assert "host" not in llm.engine.cache.tiers.names
    with LLM() as llm:
        assert "host" in llm.engine.cache.tiers.names  # on by default


def test_device_memory_fraction_splits_what_the_weights_leave_in_the_budgets_proportions(monkeypatch):
    monkeypatch.setattr(sizing, "device_memory_bytes", lambda device: (80 * GIB, 16 * GIB))  # (total, in use)
    cfg = config_with_overrides(EngineConfig(), device_memory_fraction=0.5, state_cache_gib=0.5)
    resolved = resolve_sizes(cfg, CPU, is_demo=False)
    kv, state, snap = resolved.memory.kv_cache_gib, resolved.memory.state_cache_gib, resolved.cache.device_snapshot_gib
    assert kv + state + snap == pytest.approx(0.5 * 80 - 16)
    assert (kv / snap, state / snap) == (pytest.approx(1.0), pytest.approx(0.5))


def test_device_memory_fraction_that_leaves_nothing_is_an_error(monkeypatch):
    monkeypatch.setattr(sizing, "device_memory_bytes", lambda device: (80 * GIB, 60 * GIB))
    with pytest.raises(ValueError, match="leaves nothing"):
        resolve_sizes(config_with_overrides(EngineConfig(), device_memory_fraction=0.5), CPU, is_demo=False)
    with pytest.raises(ValueError):
        config_with_overrides(EngineConfig(), device_memory_fraction=1.5)


def test_demo_model_pools_are_sized_to_the_demo():
    with LLM() as llm:
        kv_bytes = llm.engine.kv.total_bytes
        assert kv_bytes <= DEMO_DEFAULTS.kv_cache_gib * GIB
        assert llm.engine.max_model_len == llm.engine.model_config.max_position_embeddings  # still the full context


def test_device_memory_fraction_on_cpu_shares_the_machines_ram_less_this_process():
    """On CPU the fraction is of the machine's RAM, less what this process holds (its resident set, read
    from /proc/self/statm: torch alone is well above zero)."""
    ram_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    resolved = resolve_sizes(config_with_overrides(EngineConfig(), device_memory_fraction=0.5), CPU, is_demo=True)
    shared = resolved.memory.kv_cache_gib + resolved.memory.state_cache_gib + resolved.cache.device_snapshot_gib
    assert 0 < shared < 0.5 * ram_gib - 0.01


def test_machine_without_proc_meminfo_or_statm_sizes_from_sysconf(monkeypatch, caplog):
    """Without /proc (another OS, a locked-down container) available RAM is the free physical pages and
    the resident set reads as 0: the host tier still gets its default, and --device-memory-fraction
    shares the whole fraction of the machine's RAM."""
    real_open = open

    def open_without_proc(path, *args, **kwargs):
        if str(path) in ("/proc/meminfo", "/proc/self/statm"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(sizing, "open", open_without_proc, raising=False)
    free_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    with caplog.at_level(logging.INFO, logger="cairn.sizing"):
        resolved = resolve_sizes(config_with_overrides(EngineConfig(), device_memory_fraction=0.5), CPU,
                                 is_demo=False)
    seen_gib = float(caplog.text.split("% of ")[1].split(" GiB available RAM")[0])
    assert abs(seen_gib - free_gib) < 0.5 and 0 < resolved.cache.host_cache_gib <= 8.0
    ram_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    shared = resolved.memory.kv_cache_gib + resolved.memory.state_cache_gib + resolved.cache.device_snapshot_gib
    assert shared == pytest.approx(0.5 * ram_gib, rel=1e-9)  # nothing subtracted for this process
