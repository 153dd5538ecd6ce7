"""The GPU profile's limits against vLLM 0.33's own defaults (issue 41): what vLLM would pick for an
H100 under ``vllm serve`` and offline, its block size and its default ``gpu_memory_utilization``.
Needs vllm: ``make test`` runs the tests marked vllm in ``.venv-vllm``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from batch.sim import gpu_profile as gp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_calibration as cal  # noqa: E402

H100 = gp.get("h100-llama3-8b")


@pytest.mark.vllm
def test_the_limits_match_vllm_033s_own_defaults_for_an_h100(monkeypatch):
    pytest.importorskip("vllm", reason="needs vllm: make test runs the tests marked vllm in .venv-vllm")
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    monkeypatch.setattr(type(current_platform), "get_device_total_memory", lambda *a, **k: 80 * gp.GiB)
    monkeypatch.setattr(type(current_platform), "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(type(current_platform), "is_device_capability", lambda *a, **k: False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda *a, **k: False)
    tokens, seqs = EngineArgs.get_batch_defaults(world_size=1)
    assert tokens[UsageContext.OPENAI_API_SERVER] == H100.limits.max_num_batched_tokens
    assert seqs[UsageContext.OPENAI_API_SERVER] == H100.limits.max_num_seqs
    assert tokens[UsageContext.LLM_CLASS] == cal.VLLM_LLM_CLASS_MAX_NUM_BATCHED_TOKENS
    assert seqs[UsageContext.LLM_CLASS] == cal.VLLM_LLM_CLASS_MAX_NUM_SEQS
    assert CacheConfig.DEFAULT_BLOCK_SIZE == H100.limits.block_tokens
    assert CacheConfig().gpu_memory_utilization == H100.memory.gpu_memory_utilization
