"""The Mamba2 mixer against transformers' own mixers (Nemotron-H, Granite-4.0-H, Falcon-H1) on the same
random weights, copied by parameter name: one-pass prefill and cached decode (transformers' PyTorch
path, fp32); and cairn's own cache contract: prefill in pieces, or from a state captured inside a
segment, equals one pass."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, FalconH1Config, GraniteMoeHybridConfig, NemotronHConfig
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from cairn.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from cairn.ops import REFERENCE

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, CHUNK = 32, 4, 8, 2, 16, 4, 16
PROMPT, STEPS = 37, 6


# Step-size limits that bind on these random weights. transformers clamps dt in its chunked scan only, not
# in its decode step; cairn clamps in both (one recurrence, so a token costs the same state whether it was
# prefilled or decoded), so decode is compared with transformers under limits that do not bind.
BINDING = (0.05, 2.0)
NONE = (0.0, float("inf"))


def nemotron_h(limited: bool):
    cfg = NemotronHConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layers_block_type=["mamba"], mamba_num_heads=HEADS,
        mamba_head_dim=HEAD_DIM, n_groups=GROUPS, ssm_state_size=STATE, conv_kernel=KERNEL, chunk_size=CHUNK,
        use_bias=True, time_step_limit=BINDING if limited else NONE)
    return cfg, NemotronHMamba2Mixer(cfg, layer_idx=0)


def granite(limited: bool):
    cfg = GraniteMoeHybridConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["mamba"], mamba_n_heads=HEADS,
        mamba_d_head=HEAD_DIM, mamba_expand=1, mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_conv=KERNEL,
        mamba_chunk_size=CHUNK, time_step_limit=BINDING if limited else NONE)
    return cfg, GraniteMoeHybridMambaLayer(cfg, layer_idx=0)


def falcon_h1(limited: bool, rms_norm: bool):
    cfg = FalconH1Config(
        hidden_size=HIDDEN, num_hidden_layers=1, mamba_n_heads=HEADS, mamba_d_head=HEAD_DIM,
        mamba_d_ssm=HEADS * HEAD_DIM, mamba_n_groups=GROUPS, mamba_d_state=STATE, mamba_d_conv=KERNEL,
        mamba_chunk_size=CHUNK, mamba_rms_norm=rms_norm, mamba_norm_before_gate=True, mamba_proj_bias=True,
        projectors_bias=True, time_step_limit=BINDING if limited else NONE,
        ssm_in_multiplier=0.7, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9])
    mixer = FalconH1Mixer(cfg, layer_idx=0)
    mixer.register_buffer("mup_vector", compute_mup_vector(cfg), persistent=False)  # as FalconH1Model does
    return cfg, mixer


def spec_from_hf(cfg) -> Mamba2Spec:
    """What a family file does: one HF config onto the mixer's spec."""
    if cfg.model_type == "nemotron_h":
        return Mamba2Spec(
            cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size,
            cfg.conv_kernel, cfg.chunk_size, cfg.layer_norm_epsilon,
            dt_limit=tuple(cfg.time_step_limit),
            conv_bias=cfg.use_conv_bias, in_proj_bias=cfg.use_bias, out_proj_bias=cfg.use_bias)
    common = dict(
        hidden_size=cfg.hidden_size, num_heads=cfg.mamba_n_heads, head_dim=cfg.mamba_d_head,
        n_groups=cfg.mamba_n_groups, state_size=cfg.mamba_d_state, conv_kernel=cfg.mamba_d_conv,
        chunk_size=cfg.mamba_chunk_size, norm_eps=cfg.rms_norm_eps, dt_limit=tuple(cfg.time_step_limit),
        conv_bias=cfg.mamba_conv_bias, in_proj_bias=cfg.mamba_proj_bias)
    if cfg.model_type == "granitemoehybrid":
        return Mamba2Spec(**common, out_proj_bias=cfg.mamba_proj_bias)
    assert cfg.model_type == "falcon_h1"
    return Mamba2Spec(
        **common, out_proj_bias=cfg.projectors_bias, gated_norm=cfg.mamba_rms_norm,
        norm_before_gate=cfg.mamba_norm_before_gate, input_multiplier=cfg.ssm_in_multiplier,
        zxbcdt_multipliers=tuple(cfg.ssm_multipliers))


FAMILIES = {
    "nemotron_h": nemotron_h,
    "granitemoehybrid": granite,
    "falcon_h1": lambda limited: falcon_h1(limited, rms_norm=True),
    "falcon_h1_no_norm": lambda limited: falcon_h1(limited, rms_norm=False),
}


def build(family: str, limited: bool = True):
    """(HF mixer, cairn mixer) with the same random weights, copied by name (strict: every name matches)."""
    torch.manual_seed(0)
    cfg, hf = FAMILIES[family](limited)
    with torch.no_grad():  # none left at its init value (ones, log(1..H)), so a swapped name shows
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "proj" in name or "conv" in name else 0.5))
            if name == "A_log":
                p.copy_(torch.rand_like(p) - 0.5)
    ours = Mamba2Mixer(spec_from_hf(cfg))
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf.eval(), ours.eval()


def prefill(mixer: Mamba2Mixer, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
            captures=()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's segment through the mixer's own prefill pieces (what `forward` runs per sequence):
    hidden [T, hidden] -> (out [T, hidden], conv, ssm); captures (count, conv_out, ssm_out)."""
    z, xbc, dt = mixer._project(hidden)
    y, conv_state, ssm_state = mixer._scan(xbc, dt, conv_state, ssm_state, REFERENCE, captures)
    return mixer._output(y, z), conv_state, ssm_state


def decode(mixer: Mamba2Mixer, hidden: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
    """One decode step of a batch through the mixer's own step (what `forward` runs for decode rows),
    states [B, ...] updated in place."""
    z, xbc, dt = mixer._project(hidden)
    return mixer._output(mixer._step(xbc, dt, conv_state, ssm_state, REFERENCE), z)


def zero_states(mixer: Mamba2Mixer, batch: tuple[int, ...] = ()):
    spec = mixer.spec
    return torch.zeros(*batch, *spec.conv_state_shape()), torch.zeros(*batch, *spec.ssm_state_shape())


def assert_near(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4):
    assert (got - expected).abs().max().item() <= tol


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_equals_transformers_mixer(family):
    _, hf, ours = build(family)
    hidden = torch.randn(PROMPT, HIDDEN)
    with torch.no_grad():
        steps = torch.nn.functional.softplus(ours._project(hidden)[2] + ours.dt_bias)
        assert (steps < BINDING[0]).any() and (family == "nemotron_h" or (steps > BINDING[1]).any())
        expected = hf(hidden[None])[0]
        got, _, _ = prefill(ours, hidden, *zero_states(ours))
    assert_near(got, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_after_prefill_equals_transformers_cached_decode(family):
    cfg, hf, ours = build(family, limited=False)
    batch = 2
    hidden = torch.randn(batch, PROMPT + STEPS, HIDDEN)
    cache = DynamicCache(config=cfg)
    conv, ssm = zero_states(ours, (batch,))
    with torch.no_grad():
        hf(hidden[:, :PROMPT], cache=cache)
        for i in range(batch):  # prefill one sequence at a time, then decode both as one batch
            _, conv[i], ssm[i] = prefill(ours, hidden[i, :PROMPT], conv[i], ssm[i])
        for t in range(PROMPT, PROMPT + STEPS):
            expected = hf(hidden[:, t:t + 1], cache=cache)[:, 0]
            assert_near(decode(ours, hidden[:, t], conv, ssm), expected)
    assert_near(ssm, cache.layers[0].recurrent_states[0])


@pytest.mark.parametrize("family", ["nemotron_h", "falcon_h1"])
def test_prefill_in_pieces_equals_one_pass(family):
    _, _, ours = build(family)
    hidden = torch.randn(70, HIDDEN)
    with torch.no_grad():
        whole, conv_end, ssm_end = prefill(ours, hidden, *zero_states(ours))
        state = zero_states(ours)
        outs = []
        for lo, hi in [(0, 1), (1, 17), (17, 50), (50, 70)]:
            out, *state = prefill(ours, hidden[lo:hi], *state)
            outs.append(out)
    assert_near(torch.cat(outs), whole, 1e-5)
    assert torch.equal(state[0], conv_end)
    assert_near(state[1], ssm_end, 1e-5)


def test_states_captured_in_prefill_continue_exactly_in_another_slot():
    _, _, ours = build("granitemoehybrid")
    hidden = torch.randn(80, HIDDEN)
    counts = [1, 15, 16, 17, 63]
    slots = [zero_states(ours) for _ in counts]
    with torch.no_grad():
        whole, _, _ = prefill(ours, hidden, *zero_states(ours), captures=[
            (c, conv, ssm) for c, (conv, ssm) in zip(counts, slots, strict=True)])
        for c, (conv, ssm) in zip(counts, slots, strict=True):
            rest, _, _ = prefill(ours, hidden[c:], conv, ssm)
            assert_near(rest, whole[c:])
            step = decode(ours, hidden[c:c + 1], conv[None].clone(), ssm[None].clone())
            assert_near(step[0], whole[c])  # decode clamps dt as prefill does


def test_bf16_mixer_keeps_fp32_ssm_state_and_tracks_fp32():
    _, _, ours = build("nemotron_h")
    hidden = torch.randn(2, 40, HIDDEN)
    conv, ssm = zero_states(ours, (2,))
    with torch.no_grad():
        reference = torch.stack([prefill(ours, hidden[i], conv[i], ssm[i])[0] for i in range(2)])
        half = ours.to(torch.bfloat16)
        conv16, ssm16 = conv.to(torch.bfloat16), ssm.clone()
        for i in range(2):
            out, conv16[i], ssm16[i] = prefill(half, hidden[i, :39].bfloat16(), conv16[i], ssm16[i])
            assert out.dtype == torch.bfloat16
        step = decode(half, hidden[:, 39].bfloat16(), conv16, ssm16)
    assert step.dtype == torch.bfloat16 and ssm16.dtype == torch.float32
    assert (step.float() - reference[:, 39]).abs().max().item() < 0.1
