"""A GPU-shaped step cost: how long one model iteration takes on a real deployment, token by token.

The seed's stub charges 5 ms + 1 ms per scheduled request whatever the request does. A real
iteration's time grows with the prefill tokens it computes (the GEMMs are compute-bound once a
step carries a few hundred tokens), with the KV it reads (decode attention is memory-bound) and
hardly at all with the number of decode sequences while the weight read dominates. This module
holds one deployment as data and prices an iteration from what it computes:

    step = overhead
         + GEMMs(T)          soft roofline of the weight read and the FLOPs of T tokens
         + elementwise(T)    norms, rotary, activation, residual adds, embedding: linear in T
         + LM head(S)        the same soft roofline for the S sequences sampled (one row each)
         + prefill attention max(FLOPs / F(k), KV bytes / B) per prefill item
         + decode attention  KV bytes / B + a per-step cost

where T = tokens computed this step (prefill chunks and decode tokens), S = sequences in the
batch (vLLM computes logits for every scheduled request), and each item is
``(num_new_tokens, num_computed_tokens)``: the tokens it computes now and the tokens already in
the KV cache before them (prefix-cache hits included, so a cached prompt costs only its
uncached tail). An item with one new token is priced as a decode (one query row per sequence,
memory-bound); an item with more as a prefill chunk.

Profiles (``PROFILES``; ``get(name)``):

* ``h100-llama3-8b``: Llama-3-8B / Llama-3.1-8B (identical shapes; Llama-3.1's 131,072-token
  context, since the Mooncake prompts reach 126k tokens) in bf16 on one H100 SXM 80 GB (HBM3),
  vLLM's defaults for that GPU.

Where the constants come from (``bench/gpu_calibration.py`` refits them from the committed
derived data in ``bench/data/`` and prints the fit errors; ``docs/throughput.md`` has the
figures):

* GEMMs and elementwise: Vidur's H100 operator profiles of Llama-2-7B (``microsoft/vidur``, MIT,
  ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv``, tensor parallel 1, medians),
  carried to Llama-3-8B's shapes operator by operator (each GEMM scaled by its weight size: QKV
  x 0.5 for grouped-query attention, MLP x 1.302); the same carry-over predicts Vidur's measured
  A100 Llama-3-8B profile from its A100 Llama-2-7B one within a few per cent. Vidur profiles no H100
  Llama-3-8B, and its attention profiles are Git LFS objects absent from the snapshot we could read.
* Prefill attention: FlashAttention-3's measured forward throughput on an H100 80 GB SXM5, head
  dimension 128, causal (Shah et al. 2024, arXiv:2407.08608, Figure 5), fitted as
  ``F(k) = F_max * k / (k + k_half)`` over the keys attended ``k``.
* Decode attention: Vidur's A100 profile of Llama-3-8B decode attention (FlashInfer, tensor
  parallel 1; ``data/profiling/compute/a100/meta-llama/Meta-Llama-3-8B/attention.csv``, a sample of
  its rows), fitted as a per-step cost and a bandwidth, the bandwidth carried to the H100 as the
  same fraction of peak (A100 80 GB SXM: 2.039 TB/s; H100 SXM: 3.35 TB/s).
* Overhead: the rest of vLLM's published H100 latency for Llama-3.1-8B (vLLM performance
  benchmark, ``latency_llama8B_tp1``: 32 prompt tokens, 128 output tokens, batch 8, mean 997.542
  ms) once the model above has priced its 128 steps: CPU scheduling, input preparation, sampling.
* Cross-check: the roofline, 989 TFLOPS bf16 dense and 3.35 TB/s; the fitted GEMM rates are 77%
  and 80% of those, prefill attention's 66% and the KV read's 81%. Validated against vLLM's published H100 throughput for the same model
  (``throughput_llama8B_tp1``, 200 ShareGPT prompts at once, 19.50 requests/s), which the fit did
  not use (``bench/gpu_calibration.py`` prints the error).

Memory (``MemoryPlan``): the KV blocks that fit beside the weights at vLLM's default
``gpu_memory_utilization``, with the figures vLLM's own profiler logged for Meta-Llama-3-8B on an
H100 80 GB (vLLM pull request #10511, 2024-12-13: total 79.22 GiB, weights 14.96 GiB, non-torch
1.79 GiB, activation peak 1.26 GiB). ``Limits``: vLLM 0.33's defaults for a >= 70 GiB non-A100 GPU
under the OpenAI server (``vllm/engine/arg_utils.py``, ``get_batch_defaults``): 8,192 batched
tokens, 1,024 sequences; block size 16.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

__all__ = ["GPU", "ModelShape", "StepCost", "MemoryPlan", "Limits", "GPUProfile", "PROFILES", "get", "names",
           "UnknownProfileError", "GiB"]

#: Bytes in a GiB.
GiB = 1024 ** 3


class UnknownProfileError(ValueError):
    """A GPU profile name that ``PROFILES`` does not hold."""


@dataclass(frozen=True)
class GPU:
    """One accelerator's datasheet figures.

    Attributes:
        name: a label.
        peak_flops: dense bf16 tensor-core rate, FLOP/s.
        hbm_bytes_per_s: peak memory bandwidth, bytes/s.
    """

    name: str
    peak_flops: float
    hbm_bytes_per_s: float


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shapes (the counts its step cost is computed from).

    Attributes:
        name: a label.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size:
            the Hugging Face config's figures.
        max_model_len: the longest sequence (prompt + output) served, tokens.
        dtype_bytes: bytes per weight and per KV element (2 for bf16).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype_bytes: int = 2

    @property
    def layer_gemm_params(self) -> int:
        """Weights of one layer's GEMMs: QKV, output projection, gate + up, down."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        qkv = h * (self.num_heads * self.head_dim + 2 * kv)
        return qkv + self.num_heads * self.head_dim * h + 3 * h * self.intermediate_size

    @property
    def gemm_weight_bytes(self) -> int:
        """Bytes every iteration reads for the layers' GEMMs (the memory-bound floor)."""
        return self.layer_gemm_params * self.num_layers * self.dtype_bytes

    @property
    def gemm_flops_per_token(self) -> int:
        """FLOPs of the layers' GEMMs per token computed (2 per weight)."""
        return 2 * self.layer_gemm_params * self.num_layers

    @property
    def lm_head_bytes(self) -> int:
        """Bytes of the LM head (hidden x vocabulary), read once per iteration."""
        return self.hidden_size * self.vocab_size * self.dtype_bytes

    @property
    def lm_head_flops_per_row(self) -> int:
        """FLOPs of the LM head per sampled sequence."""
        return 2 * self.hidden_size * self.vocab_size

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV cache bytes one token holds in one layer: K and V, each kv heads x head dim."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token holds over all layers."""
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def attn_flops_per_query_key(self) -> int:
        """Attention FLOPs per (query token, key token) pair over all layers: QK^T and PV, each
        2 x heads x head dim."""
        return 4 * self.num_heads * self.head_dim * self.num_layers


@dataclass(frozen=True)
class StepCost:
    """The fitted constants of the step time (see the module docstring for the formula and sources).

    Attributes:
        overhead_s: fixed cost of one iteration, seconds.
        gemm_bytes_per_s: effective weight-read bandwidth of the GEMMs, bytes/s.
        gemm_flops_per_s: effective GEMM rate, FLOP/s.
        roofline_p: exponent of the soft roofline ``(m**p + c**p) ** (1/p)`` joining the memory
            time ``m`` and the compute time ``c`` (large p: the sharp ``max``).
        elementwise_s: per-iteration part of the elementwise operators, seconds.
        elementwise_s_per_token: their cost per token computed, seconds.
        attn_prefill_flops_per_s: prefill attention's rate at long key lengths, FLOP/s.
        attn_prefill_half_keys: the key length at which it reaches half that rate, tokens.
        attn_kv_bytes_per_s: the KV read bandwidth of attention, bytes/s.
        attn_decode_s: per-iteration cost of decode attention when any sequence decodes, seconds.
    """

    overhead_s: float
    gemm_bytes_per_s: float
    gemm_flops_per_s: float
    roofline_p: float
    elementwise_s: float
    elementwise_s_per_token: float
    attn_prefill_flops_per_s: float
    attn_prefill_half_keys: float
    attn_kv_bytes_per_s: float
    attn_decode_s: float

    def soft_roofline_s(self, bytes_read: float, flops: float) -> float:
        """Seconds of a GEMM that reads ``bytes_read`` and computes ``flops`` (0 when both are 0)."""
        m = bytes_read / self.gemm_bytes_per_s
        c = flops / self.gemm_flops_per_s
        p = self.roofline_p
        return (m ** p + c ** p) ** (1.0 / p) if m or c else 0.0

    def prefill_attn_flops_per_s(self, keys: float) -> float:
        """Prefill attention's rate when each query attends ``keys`` keys, FLOP/s."""
        return self.attn_prefill_flops_per_s * keys / (keys + self.attn_prefill_half_keys)


@dataclass(frozen=True)
class MemoryPlan:
    """vLLM's KV cache sizing: ``total x gpu_memory_utilization - weights - non-torch - activation
    peak``, in whole blocks (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``).

    Attributes:
        total_bytes: device memory as the driver reports it, bytes.
        gpu_memory_utilization: the share of it vLLM may use.
        weights_bytes: the loaded weights, bytes.
        non_torch_bytes: memory outside PyTorch's allocator (CUDA context, NCCL, cuBLAS), bytes.
        activation_bytes: the profile run's activation peak, bytes.
        source: where the figures come from.
    """

    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    non_torch_bytes: int
    activation_bytes: int
    source: str = ""

    def kv_bytes(self, gpu_memory_utilization: float | None = None) -> int:
        """Bytes left for the KV cache (at ``gpu_memory_utilization``, default the plan's).

        Raises:
            ValueError: the utilization is outside ``(0, 1]``, or nothing is left for the cache.
        """
        u = self.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
        if not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {u!r}")
        left = int(self.total_bytes * u) - self.weights_bytes - self.non_torch_bytes - self.activation_bytes
        if left <= 0:
            raise ValueError(f"nothing left for the KV cache at gpu_memory_utilization={u}: "
                             f"{left / GiB:.2f} GiB")
        return left

    def num_blocks(self, model: ModelShape, block_tokens: int = 16,
                   gpu_memory_utilization: float | None = None) -> int:
        """Whole KV blocks of ``block_tokens`` tokens that fit: ``kv_bytes // (block_tokens x KV bytes a token)``.

        Raises:
            ValueError: ``block_tokens`` is not an int >= 1, or as ``kv_bytes``.
        """
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        return self.kv_bytes(gpu_memory_utilization) // (block_tokens * model.kv_bytes_per_token)


@dataclass(frozen=True)
class Limits:
    """The serving limits both schedulers of a comparison get (vLLM's names).

    Attributes:
        num_gpu_blocks: KV cache blocks (Batch's ``kv_cap_blocks``).
        block_tokens: tokens per block (``block_size``).
        max_num_batched_tokens: tokens per iteration (Batch's ``token_budget_tokens``).
        max_num_seqs: most sequences resident (Batch's ``max_running``).
        max_model_len: longest prompt + output served, tokens.
    """

    num_gpu_blocks: int
    block_tokens: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    def scheduler_kwargs(self) -> dict[str, int]:
        """The limits as ``scheduler.Scheduler`` keyword arguments."""
        return {"kv_cap_blocks": self.num_gpu_blocks, "block_tokens": self.block_tokens,
                "token_budget_tokens": self.max_num_batched_tokens, "max_running": self.max_num_seqs}


Item = tuple[int, int]


@dataclass(frozen=True)
class GPUProfile:
    """One deployment: the GPU, the model, the fitted step cost, the memory plan and the limits.

    Attributes:
        name: the profile's name (``PROFILES`` key, ``--gpu NAME``).
        gpu, model, cost, memory: as their classes.
        limits: the serving limits both sides of a comparison get; ``num_gpu_blocks`` is
            ``memory.num_blocks(model, block_tokens)``.
        sources: what each part was fitted to (printed by the benchmarks).
    """

    name: str
    gpu: GPU
    model: ModelShape
    cost: StepCost
    memory: MemoryPlan
    limits: Limits
    sources: Mapping[str, str] = field(default_factory=dict)

    def breakdown(self, items: Iterable[Item]) -> dict[str, float]:
        """The step time of ``items`` by part, seconds: ``overhead``, ``gemm``, ``elementwise``,
        ``lm_head``, ``attn_prefill``, ``attn_decode`` and their ``total``; all 0 for no items.

        Args:
            items: ``(num_new_tokens, num_computed_tokens)`` per scheduled sequence: tokens computed
                now (>= 1) and tokens already in its KV cache before them (>= 0).

        Raises:
            ValueError: an item is not a pair of ints with ``num_new_tokens >= 1`` and
                ``num_computed_tokens >= 0``.
        """
        m, c = self.model, self.cost
        tokens = seqs = decodes = 0
        pre_s = dec_bytes = 0.0
        kvb = m.kv_bytes_per_token_layer * m.num_layers
        for it in items:
            try:
                new, ctx = it
            except (TypeError, ValueError):
                raise ValueError(f"an item is (num_new_tokens, num_computed_tokens), got {it!r}") from None
            if (isinstance(new, bool) or isinstance(ctx, bool) or not isinstance(new, int)
                    or not isinstance(ctx, int) or new < 1 or ctx < 0):
                raise ValueError(f"an item needs num_new_tokens >= 1 and num_computed_tokens >= 0 (ints), "
                                 f"got {it!r}")
            tokens += new
            seqs += 1
            keys = ctx + new
            if new == 1:
                decodes += 1
                dec_bytes += keys * kvb
            else:
                # causal within the chunk: query j attends ctx + j + 1 keys
                flops = m.attn_flops_per_query_key * new * (ctx + (new + 1) / 2.0)
                pre_s += max(flops / c.prefill_attn_flops_per_s(keys), keys * kvb / c.attn_kv_bytes_per_s)
        if not seqs:
            return dict.fromkeys(("overhead", "gemm", "elementwise", "lm_head", "attn_prefill", "attn_decode",
                                  "total"), 0.0)
        parts = {
            "overhead": c.overhead_s,
            "gemm": c.soft_roofline_s(m.gemm_weight_bytes, tokens * m.gemm_flops_per_token),
            "elementwise": c.elementwise_s + c.elementwise_s_per_token * tokens,
            "lm_head": c.soft_roofline_s(m.lm_head_bytes, seqs * m.lm_head_flops_per_row),
            "attn_prefill": pre_s,
            "attn_decode": c.attn_decode_s + dec_bytes / c.attn_kv_bytes_per_s if decodes else 0.0,
        }
        parts["total"] = sum(parts.values())
        return parts

    def step_time_s(self, items: Iterable[Item]) -> float:
        """Seconds one iteration computing ``items`` takes (``breakdown(items)["total"]``; 0 for none).

        Raises:
            ValueError: as ``breakdown``.
        """
        return self.breakdown(items)["total"]

    def describe(self) -> str:
        """One line: the deployment and its limits."""
        lim = self.limits
        return (f"{self.name}: {self.model.name} bf16 on {self.gpu.name}; KV {lim.num_gpu_blocks:,} blocks x "
                f"{lim.block_tokens} tokens, max_num_batched_tokens {lim.max_num_batched_tokens}, max_num_seqs "
                f"{lim.max_num_seqs}, max_model_len {lim.max_model_len:,}")


# ----------------------------------------------------------------------------- the deployment

#: H100 SXM5 80 GB: 989 TFLOPS dense bf16, 3.35 TB/s HBM3 (NVIDIA's H100 datasheet).
H100_SXM = GPU("H100 SXM 80GB", peak_flops=989e12, hbm_bytes_per_s=3.35e12)
#: A100 SXM4 80 GB: 312 TFLOPS dense bf16, 2.039 TB/s (the GPU of Vidur's A100 profiles).
A100_SXM = GPU("A100 SXM 80GB", peak_flops=312e12, hbm_bytes_per_s=2.039e12)

#: Llama-3-8B's shapes (Llama-3.1-8B: the same, with a 131,072-token context, served here).
LLAMA3_8B = ModelShape("Llama-3.1-8B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=14336, vocab_size=128256, max_model_len=131072)

#: The fitted constants (bench/gpu_calibration.py prints them and their errors; tests check them).
H100_LLAMA3_8B_COST = StepCost(
    overhead_s=1.15e-3,
    gemm_bytes_per_s=2.69e12,
    gemm_flops_per_s=7.61e14,
    roofline_p=1.2,
    elementwise_s=4.19e-4,
    elementwise_s_per_token=2.67e-6,
    attn_prefill_flops_per_s=6.54e14,
    attn_prefill_half_keys=600.0,
    attn_kv_bytes_per_s=2.71e12,
    attn_decode_s=4.92e-4,
)

#: vLLM's profiler on Meta-Llama-3-8B, one H100 80 GB (vLLM pull request #10511, 2024-12-13), at
#: vLLM 0.33's default gpu_memory_utilization, 0.92 (``vllm/config/cache.py``; it was 0.90 before).
H100_LLAMA3_8B_MEMORY = MemoryPlan(
    total_bytes=round(79.22 * GiB), gpu_memory_utilization=0.92, weights_bytes=round(14.96 * GiB),
    non_torch_bytes=round(1.79 * GiB), activation_bytes=round(1.26 * GiB),
    source="vLLM PR #10511 memory profile of Meta-Llama-3-8B on one H100 80GB; vLLM 0.33 default utilization 0.92")

#: vLLM 0.33 ``EngineArgs.get_batch_defaults`` for a GPU of >= 70 GiB that is not an A100, usage
#: context OPENAI_API_SERVER (``vllm serve``); block size ``CacheConfig.DEFAULT_BLOCK_SIZE``.
VLLM_SERVER_MAX_NUM_BATCHED_TOKENS = 8192
VLLM_SERVER_MAX_NUM_SEQS = 1024
BLOCK_TOKENS = 16


def _profile() -> GPUProfile:
    lim = Limits(num_gpu_blocks=H100_LLAMA3_8B_MEMORY.num_blocks(LLAMA3_8B, BLOCK_TOKENS), block_tokens=BLOCK_TOKENS,
                 max_num_batched_tokens=VLLM_SERVER_MAX_NUM_BATCHED_TOKENS, max_num_seqs=VLLM_SERVER_MAX_NUM_SEQS,
                 max_model_len=LLAMA3_8B.max_model_len)
    return GPUProfile("h100-llama3-8b", H100_SXM, LLAMA3_8B, H100_LLAMA3_8B_COST, H100_LLAMA3_8B_MEMORY, lim, sources={
        "gemm": "Vidur H100 Llama-2-7B mlp.csv (MIT), carried to Llama-3-8B shapes per operator",
        "prefill attention": "FlashAttention-3 (arXiv:2407.08608) Fig. 5, H100 SXM5, hdim 128, causal",
        "decode attention": "Vidur A100 Llama-3-8B attention.csv (MIT) sample, bandwidth share carried to H100",
        "overhead": "vLLM perf benchmark latency_llama8B_tp1 on H100: 997.542 ms (32 in, 128 out, batch 8)",
        "memory": H100_LLAMA3_8B_MEMORY.source,
        "limits": "vLLM 0.33 defaults, >= 70 GiB GPU, vllm serve: 8192 batched tokens, 1024 sequences",
    })


#: Every profile, by name (``--gpu NAME``).
PROFILES: dict[str, GPUProfile] = {p.name: p for p in (_profile(),)}


def names() -> tuple[str, ...]:
    """The profile names, sorted."""
    return tuple(sorted(PROFILES))


def get(name: str) -> GPUProfile:
    """The profile called ``name``.

    Raises:
        UnknownProfileError: no such profile (the message lists the known ones).
    """
    try:
        return PROFILES[name]
    except (KeyError, TypeError):
        raise UnknownProfileError(f"unknown GPU profile {name!r}; known: {', '.join(names())}") from None

