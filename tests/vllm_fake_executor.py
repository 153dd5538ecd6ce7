"""A model executor for ``vllm serve --distributed-executor-backend vllm_fake_executor.FakeExecutor``
that runs no model, so that vLLM's real server, engine and scheduler serve completions on a CPU
where vLLM's CUDA wheel cannot run one (it lacks ``vllm._C``: ``docs/vllm-plugin.md``).

It stands where ``UniProcExecutor``'s worker would: one full-attention KV cache layer of
``NUM_BLOCKS`` blocks, and a step samples, for each request whose computed tokens reach the end
of its known sequence, token ``TOKEN`` (never the EOS: a request runs to its ``max_tokens``).
It says it supports async scheduling, so vLLM keeps that default on. With
``$BATCH_FAKE_EXECUTOR_LOG`` set, it appends one JSON line per request it first sees:
``{"request_id", "user"}`` (``sampling_params.extra_args["user"]``). Used by
``tests/test_vllm_serve.py``; not part of the package.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import Future
from typing import Any, Callable

import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes

NUM_BLOCKS = 512
TOKEN = 7
LOG_ENV = "BATCH_FAKE_EXECUTOR_LOG"


class FakeWorker:
    """The worker side: KV cache shape, and the fake forward over each ``SchedulerOutput``."""

    def __init__(self, vllm_config) -> None:
        self.block_size = vllm_config.cache_config.block_size or 16
        self.spec = FullAttentionSpec(block_size=self.block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
        self.known: dict[str, int] = {}  # request id -> tokens the runner knows (prompt + sampled)
        self.pending: ModelRunnerOutput | None = None
        self.log = os.environ.get(LOG_ENV)

    def get_kv_cache_spec(self) -> dict:
        return {"model.layers.0.self_attn.attn": self.spec}

    def determine_available_memory(self) -> int:
        return self.spec.page_size_bytes * NUM_BLOCKS

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def set_kv_cache_layout(self, *args, **kwargs) -> None:
        return None

    def initialize_from_config(self, kv_cache_configs) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_kv_connector_handshake_metadata(self):
        return None

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def execute_model(self, scheduler_output) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self.known and self.log:
                sp = new.sampling_params
                user = (sp.extra_args or {}).get("user") if sp is not None else None
                with open(self.log, "a") as f:
                    f.write(json.dumps({"request_id": new.req_id, "user": user}) + "\n")
            self.known[new.req_id] = len(new.prompt_token_ids or ())
        start = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid in scheduler_output.finished_req_ids:
            self.known.pop(rid, None)
        ids, sampled = list(scheduler_output.num_scheduled_tokens), []
        for rid in ids:
            if start[rid] + scheduler_output.num_scheduled_tokens[rid] >= self.known[rid]:
                self.known[rid] += 1
                sampled.append([TOKEN])
            else:
                sampled.append([])  # mid-prefill
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        if not ids:  # nothing to sample: the output now, as vLLM's model runner does
            return out
        self.pending = out
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        out, self.pending = self.pending, None
        return out

    def take_draft_token_ids(self):
        return None

    def __getattr__(self, name: str):  # control RPCs with nothing to do without a model (reset_mm_cache, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class FakeExecutor(Executor):
    """``Executor`` over one in-process ``FakeWorker`` (``UniProcExecutor``'s shape, no model)."""

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.worker = FakeWorker(self.vllm_config)

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None, non_block: bool = False, single_value: bool = False) -> Any:
        fn = getattr(self.worker, method) if isinstance(method, str) else (lambda *a, **k: method(self.worker, *a, **k))
        try:
            result = fn(*args, **(kwargs or {}))
        except Exception as e:
            if not non_block:
                raise
            future: Future = Future()
            future.set_exception(e)
            return future
        value = result if single_value else [result]
        if not non_block:
            return value
        future = Future()
        future.set_result(value)
        return future

    def execute_model(self, scheduler_output, non_block: bool = False):
        return self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block, single_value=True)

    def sample_tokens(self, grammar_output, non_block: bool = False):
        return self.collective_rpc("sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True)

    def take_draft_token_ids(self):
        return None

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
