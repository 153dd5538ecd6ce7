"""The GPU-shaped step cost (issue 41): ``batch.sim.gpu_profile`` and its calibration
(``bench/gpu_calibration.py``); the backend and the ``--gpu`` options are ``tests/test_gpu_clock.py``'s.

The cost model's shape is checked on its own terms (monotone in the prefill tokens and in the KV
read, a decode batch nearly flat while the weight read dominates, a prefix hit cheaper than its
recompute); the committed constants against their refit from the derived data in ``bench/data/``
and against the published latency they were fitted to; the cache sizing against vLLM's formula
done by hand; the limits against vLLM 0.33's own defaults in ``tests/test_vllm_gpu_profile.py`` (vllm needed).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from batch.sim import gpu_profile as gp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_calibration as cal  # noqa: E402

H100 = gp.get("h100-llama3-8b")


def t(items) -> float:
    return H100.step_time_s(items)


# ----------------------------------------------------------------------------- the cost's shape

def test_step_time_grows_with_the_prefill_tokens_computed():
    sizes = [2, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    times = [t([(n, 0)]) for n in sizes]
    assert all(a < b for a, b in zip(times, times[1:])), times
    assert times[-1] > 20 * times[0]  # compute-bound: 8192 tokens cost far more than a 2-token chunk


@pytest.mark.parametrize("new", [1, 64, 2048])
def test_step_time_grows_with_the_kv_read(new):
    ctx = [0, 512, 4096, 16384, 65536]
    times = [t([(new, c)] * 8) for c in ctx]
    assert all(a < b for a, b in zip(times, times[1:])), times


def test_a_decode_batch_is_nearly_flat_until_the_compute_shows():
    one = t([(1, 16)])
    assert t([(1, 16)] * 32) < 1.10 * one  # 32 short decodes: the weight read dominates
    assert t([(1, 16)] * 128) < 1.35 * one
    assert t([(1, 16)] * 1024) > 2.0 * one  # then the tokens' compute and the KV read show
    parts = H100.breakdown([(1, 16)] * 32)
    assert parts["gemm"] > 0.6 * parts["total"]


def test_a_prefix_hit_costs_only_the_uncached_tail():
    assert t([(2048, 8192)]) < 0.5 * t([(10240, 0)])
    assert t([(2048, 8192)]) > t([(2048, 0)])  # but attending to the cached prefix is not free


def test_breakdown_sums_to_the_total_and_an_empty_step_costs_nothing():
    parts = H100.breakdown([(64, 0), (1, 300), (1, 5000)])
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    assert all(v > 0 for v in parts.values())
    assert t([]) == 0.0 and H100.breakdown([])["total"] == 0.0


@pytest.mark.parametrize("bad", [(0, 5), (-1, 0), (3, -1), ("a", 1), (1.0, 2), (True, 0), (1,), 7, None])
def test_a_malformed_item_is_a_value_error(bad):
    with pytest.raises(ValueError, match="num_new_tokens"):
        t([(1, 0), bad])


def test_an_unknown_profile_is_a_value_error_naming_the_known_ones():
    with pytest.raises(gp.UnknownProfileError, match="h100-llama3-8b"):
        gp.get("h100-llama99")
    assert issubclass(gp.UnknownProfileError, ValueError)
    assert gp.names() == ("h100-llama3-8b",)


# ----------------------------------------------------------------------------- the calibration

@pytest.fixture(scope="module")
def refit():
    return cal.fit_all()


def test_the_committed_constants_are_the_refit_ones(refit):
    cost, _, _ = refit
    for f in dataclasses.fields(gp.StepCost):
        assert getattr(H100.cost, f.name) == pytest.approx(getattr(cost, f.name), rel=cal.TOLERANCE), f.name


def test_the_fits_reproduce_their_calibration_points_within_the_stated_error(refit):
    _, fits, check = refit
    rms = {f.name.split(" (")[0]: f.rms() for f in fits}
    assert rms["GEMMs"] <= 0.07  # Vidur H100 Llama-2-7B GEMMs carried to Llama-3-8B, 259 token counts
    assert rms["elementwise"] <= 0.12
    assert rms["prefill attention"] <= 0.03  # FlashAttention-3's H100 curve
    assert rms["decode attention"] <= 0.08  # Vidur's A100 decode sample
    a100 = check["a100"]  # the carry-over itself, where both models were measured
    assert abs(a100.mean()) <= 0.03 and math.sqrt((a100 ** 2).mean()) <= 0.05


def test_the_fitted_rates_are_below_the_roofline():
    c, g = H100.cost, H100.gpu
    assert 0.6 * g.hbm_bytes_per_s < c.gemm_bytes_per_s < g.hbm_bytes_per_s
    assert 0.6 * g.peak_flops < c.gemm_flops_per_s < g.peak_flops
    assert c.attn_prefill_flops_per_s < g.peak_flops and c.attn_kv_bytes_per_s < g.hbm_bytes_per_s


def test_the_model_reproduces_vllms_published_latency_it_was_fitted_to():
    steps = cal.latency_steps(**cal.VLLM_LATENCY_SHAPE)
    assert len(steps) == 128 and steps[0] == [(32, 0)] * 8 and steps[-1] == [(1, 158)] * 8
    assert sum(t(s) for s in steps) * 1e3 == pytest.approx(cal.VLLM_LATENCY_H100_MS, rel=0.01)


def test_the_derived_data_name_their_source_and_licence():
    readme = (ROOT / "bench" / "data" / "README.md").read_text()
    for f in (cal.MLP_CSV, cal.DECODE_CSV):
        assert f.name in readme
        head = f.read_text().splitlines()[0]
        assert head.startswith("#") and "MIT" in head and "microsoft/vidur" in head


# ----------------------------------------------------------------------------- the cache and limits

def test_kv_bytes_a_token_of_llama3_8b():
    m = H100.model
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072  # K and V, 32 layers, 8 kv heads, dim 128, bf16
    assert m.gemm_weight_bytes + m.lm_head_bytes + m.hidden_size * m.vocab_size * 2 == pytest.approx(16.06e9, rel=0.01)


def test_the_cache_is_vllms_formula_done_by_hand():
    gib, per_block = gp.GiB, 16 * 131072
    left = 79.22 * 0.92 - (14.96 + 1.79 + 1.26)  # GiB: total x utilization - weights - non-torch - activations
    assert H100.limits.num_gpu_blocks == math.floor(left * gib / per_block) == 28094
    # at the old default, 0.90, the 53.29 GiB vLLM logged for this model on this GPU
    assert H100.memory.kv_bytes(0.90) / gib == pytest.approx(53.29, abs=0.01)
    assert H100.memory.num_blocks(H100.model, 16, gpu_memory_utilization=0.90) == math.floor(
        (79.22 * 0.90 - 18.01) * gib / per_block) == 27283


@pytest.mark.parametrize("util", [0.0, -0.1, 1.5, float("nan")])
def test_a_bad_utilization_is_a_value_error(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        H100.memory.kv_bytes(util)


def test_too_little_memory_for_the_weights_is_a_value_error():
    with pytest.raises(ValueError, match="nothing left"):
        H100.memory.kv_bytes(0.2)


@pytest.mark.parametrize("bad", [0, -16, 1.5, True])
def test_a_bad_block_size_is_a_value_error(bad):
    with pytest.raises(ValueError, match="block_tokens"):
        H100.memory.num_blocks(H100.model, bad)


def test_the_limits_are_vllms_h100_server_defaults():
    lim = H100.limits
    assert (lim.block_tokens, lim.max_num_batched_tokens, lim.max_num_seqs, lim.max_model_len) == (16, 8192, 1024, 131072)
    assert lim.scheduler_kwargs() == {"kv_cap_blocks": 28094, "block_tokens": 16, "token_budget_tokens": 8192,
                                      "max_running": 1024}
