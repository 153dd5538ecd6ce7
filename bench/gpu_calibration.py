#!/usr/bin/env python3
"""Fit the GPU step-cost model (``batch/sim/gpu_profile.py``) to published measurements and print
how well it fits, and how far it lands from published end-to-end figures it was not fitted to.

What it fits, from the derived data in ``bench/data/`` (``bench/data/README.md`` names each source
and its licence) and the published figures quoted below:

1. GEMMs and elementwise operators: Vidur's H100 Llama-2-7B operator times, carried to Llama-3-8B's
   shapes operator by operator (``carry_to_llama3``: each GEMM scaled by its weight size, each
   elementwise operator by its width). The carry-over itself is checked where both sides were
   measured: Vidur's A100 Llama-2-7B profile carried the same way against its A100 Llama-3-8B one.
   The GEMMs are fitted as the soft roofline ``((W/B)**p + (T*f/F)**p)**(1/p)`` (W: weight bytes,
   f: FLOPs a token, T: tokens; B, F, p fitted), the rest as ``a + b*T``.
2. Prefill attention: FlashAttention-3's forward throughput on an H100 SXM5 (head dim 128, causal;
   Shah et al. 2024, arXiv:2407.08608, Figure 5), as ``F(k) = F_max * k / (k + k_half)``.
3. Decode attention: Vidur's A100 Llama-3-8B decode-attention sample as ``a + c*batch + bytes/B``
   per layer; B is carried to the H100 as the same share of peak bandwidth.
4. Overhead: the part of vLLM's published H100 latency for Llama-3.1-8B (performance benchmark
   ``latency_llama8B_tp1``: 32 prompt tokens, 128 output tokens, batch 8, mean 997.542 ms) the
   fitted model leaves unexplained, shared over its 128 steps.

Then the check against a figure the fit did not see: vLLM's published H100 throughput for the same
model (``throughput_llama8B_tp1``: 200 ShareGPT prompts submitted at once, 19.5005 requests/s),
replayed through vLLM 0.33's own scheduler on this clock (when vllm imports: ``.venv-vllm``) and
through Batch, with prompt/output lengths drawn from the ShareGPT V3 first turns in the traces
folder (cl100k token counts; vLLM's benchmark filter: prompt and output >= 4, prompt <= 1024,
prompt + output <= 2048), over several draws of the 200.

The published figures (vLLM's public performance dashboard, H100 row, as archived at
https://buildkite.com/elastic/enterprise-search-ruby/builds/571, a mislabelled mirror of vLLM's
``performance-benchmark`` pipeline; its H200 run is https://buildkite.com/vllm/performance-benchmark/builds/9515)
are typed below as constants with that source.

Usage, from the repository root::

    python bench/gpu_calibration.py                    # fit, print constants and errors (markdown)
    .venv-vllm/bin/python bench/gpu_calibration.py     # ... and the throughput check through vLLM too
    python bench/gpu_calibration.py --extract /work/.mirror/microsoft+vidur/repo   # rewrite bench/data/vidur_mlp_tp1.csv

Exit status 1 when a committed constant of ``gpu_profile`` differs from its refit by more than
``TOLERANCE`` (the committed profile must be what the data says).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from batch.sim import gpu_profile as gp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

DATA = HERE / "data"
MLP_CSV = DATA / "vidur_mlp_tp1.csv"
DECODE_CSV = DATA / "vidur_attn_decode_a100_llama3_8b.csv"
#: The profile these data calibrate.
PROFILE = "h100-llama3-8b"
#: A refit constant may differ from the committed one by this share (rounding to 3 digits).
TOLERANCE = 0.02

#: Vidur's per-layer operators (``time_stats.<op>.median``) and ``emb`` (once per step).
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = tuple(o for o in LAYER_OPS if o not in GEMM_OPS)
#: Vidur's profiles: (gpu, model folder) -> the label used in the derived CSV.
VIDUR_FILES = {("h100", "Llama-2-7b-hf"): "h100/meta-llama/Llama-2-7b-hf/mlp.csv",
               ("a100", "Llama-2-7b-hf"): "a100/meta-llama/Llama-2-7b-hf/mlp.csv",
               ("a100", "Meta-Llama-3-8B"): "a100/meta-llama/Meta-Llama-3-8B/mlp.csv"}
MAX_TOKENS = 4096

#: Llama-2-7B's shapes (Vidur's profiled model), to carry its operators to Llama-3-8B.
LLAMA2_7B = gp.ModelShape("Llama-2-7B", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                          intermediate_size=11008, vocab_size=32000, max_model_len=4096)

#: FlashAttention-3 forward, H100 80GB SXM5, head dim 128, causal mask, FP16 (bf16 runs at the same
#: tensor-core rate): sequence length -> TFLOPS/s. Shah et al. 2024, arXiv:2407.08608, Figure 5.
FA3_CAUSAL_HDIM128_TFLOPS = {512: 292.0, 1024: 423.0, 2048: 521.0, 4096: 579.0, 8192: 602.0, 16384: 616.0}

#: vLLM performance benchmark, H100 (module docstring): latency test and throughput test.
VLLM_LATENCY_H100_MS = 997.542
VLLM_LATENCY_SHAPE = {"prompt_tokens": 32, "output_tokens": 128, "batch": 8}
VLLM_THROUGHPUT_H100_REQ_S = 19.5005
VLLM_THROUGHPUT_PROMPTS = 200
#: vLLM 0.33's defaults for the LLM class (offline, what the throughput test runs) on a >= 70 GiB GPU.
VLLM_LLM_CLASS_MAX_NUM_BATCHED_TOKENS = 16384
VLLM_LLM_CLASS_MAX_NUM_SEQS = 1024
SHAREGPT = "sharegpt_v3_first_turn_lengths_cl100k.csv"


# ----------------------------------------------------------------------------- data

def extract(vidur: Path, out: Path = MLP_CSV) -> int:
    """Write the derived operator table from a Vidur checkout or bare git directory; returns rows.

    Raises:
        FileNotFoundError: a profile file is missing there.
    """
    rows = []
    for (gpu, model), rel in VIDUR_FILES.items():
        path = Path(vidur) / "data" / "profiling" / "compute" / rel
        if path.is_file():
            text = path.read_text()
        else:
            proc = subprocess.run(["git", f"--git-dir={vidur}", "show", f"HEAD:data/profiling/compute/{rel}"],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise FileNotFoundError(f"no {rel} under {vidur}")
            text = proc.stdout
        for r in csv.DictReader(io.StringIO(text)):
            if r["num_tensor_parallel_workers"] != "1" or int(r["num_tokens"]) > MAX_TOKENS:
                continue
            rows.append([gpu, model, int(r["num_tokens"]),
                         *(round(float(r[f"time_stats.{o}.median"]), 4) for o in ("emb", *LAYER_OPS))])
    with out.open("w", newline="") as f:
        f.write("# Vidur (microsoft/vidur, MIT, Copyright (c) Microsoft Corporation) data/profiling/compute/*/mlp.csv:\n"
                "# time_stats.<op>.median (ms), num_tensor_parallel_workers == 1 (bench/data/README.md)\n")
        w = csv.writer(f)
        w.writerow(["gpu", "model", "num_tokens", "emb", *LAYER_OPS])
        w.writerows(sorted(rows, key=lambda r: (r[0], r[1], r[2])))
    return len(rows)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def load_mlp(path: Path = MLP_CSV) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """``{(gpu, model): {num_tokens: {op: ms}}}`` from the derived table."""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for r in _rows(path):
        out.setdefault((r["gpu"], r["model"]), {})[int(r["num_tokens"])] = {
            k: float(v) for k, v in r.items() if k not in ("gpu", "model", "num_tokens")}
    return out


def load_decode(path: Path = DECODE_CSV) -> list[tuple[int, int, float]]:
    """``[(batch_size, kv_cache_size, ms per layer)]`` from the derived decode-attention sample."""
    return [(int(r["batch_size"]), int(r["kv_cache_size"]), float(r["attn_decode_ms"])) for r in _rows(path)]


# ----------------------------------------------------------------------------- carry-over

def op_ratios(src: gp.ModelShape, dst: gp.ModelShape) -> dict[str, float]:
    """How much more work each per-layer operator does in ``dst`` than in ``src`` (same hidden size):
    a GEMM by its weight count, an elementwise operator by the width it touches."""
    h = src.hidden_size
    assert dst.hidden_size == h, "the carry-over keeps the hidden size"

    def qkv(m: gp.ModelShape) -> int:
        return (m.num_heads + 2 * m.num_kv_heads) * m.head_dim

    def rope(m: gp.ModelShape) -> int:
        return (m.num_heads + m.num_kv_heads) * m.head_dim
    mlp = dst.intermediate_size / src.intermediate_size
    return {"attn_pre_proj": qkv(dst) / qkv(src), "attn_post_proj": 1.0, "mlp_up_proj": mlp, "mlp_down_proj": mlp,
            "mlp_act": mlp, "input_layernorm": 1.0, "post_attention_layernorm": 1.0, "attn_rope": rope(dst) / rope(src),
            "add": 1.0}


def carry(table: dict[int, dict[str, float]], ops: Sequence[str], ratios: dict[str, float], layers: int,
          emb: bool = False) -> dict[int, float]:
    """Step time (s) of ``ops`` over ``layers`` layers at each token count, scaled by ``ratios``."""
    return {t: (layers * sum(ratios[o] * v[o] for o in ops) + (v["emb"] if emb else 0.0)) / 1e3
            for t, v in sorted(table.items())}


def measured(table: dict[int, dict[str, float]], ops: Sequence[str], layers: int, emb: bool = False) -> dict[int, float]:
    return carry(table, ops, dict.fromkeys(ops, 1.0), layers, emb)


def rel_errors(pred: dict[int, float], meas: dict[int, float]) -> np.ndarray:
    keys = sorted(set(pred) & set(meas))
    return np.array([(pred[k] - meas[k]) / meas[k] for k in keys])


# ----------------------------------------------------------------------------- fits

@dataclasses.dataclass
class Fit:
    """A fitted part: its constants, and the relative errors over the points it was fitted to."""

    name: str
    constants: dict[str, float]
    errors: np.ndarray
    points: int

    def rms(self) -> float:
        return float(np.sqrt(np.mean(self.errors ** 2)))

    def worst(self) -> float:
        return float(np.max(np.abs(self.errors)))


def fit_gemm(target: dict[int, float], model: gp.ModelShape) -> Fit:
    """The soft roofline (B, F, p) minimising the rms relative error over ``target`` (s by tokens)."""
    t = np.array(sorted(target), float)
    y = np.array([target[int(k)] for k in t])
    w, f = model.gemm_weight_bytes, model.gemm_flops_per_token
    bws = np.arange(2.0e12, 3.35e12 + 1, 0.01e12)[:, None, None]
    fls = np.arange(5.0e14, 9.89e14 + 1, 1e12)[None, :, None]
    best = None
    for p in np.round(np.arange(1.0, 2.01, 0.1), 2):
        pred = ((w / bws) ** p + (t[None, None, :] * f / fls) ** p) ** (1 / p)
        rms = np.sqrt(np.mean(((pred - y) / y) ** 2, axis=2))
        i, j = np.unravel_index(np.argmin(rms), rms.shape)
        if best is None or rms[i, j] < best[0]:
            best = (rms[i, j], float(bws[i, 0, 0]), float(fls[0, j, 0]), float(p))
    _, bw, fl, p = best
    cost = dataclasses.replace(gp.get(PROFILE).cost, gemm_bytes_per_s=bw, gemm_flops_per_s=fl, roofline_p=p)
    pred = {int(k): cost.soft_roofline_s(w, k * f) for k in t}
    return Fit("GEMMs (soft roofline)", {"gemm_bytes_per_s": bw, "gemm_flops_per_s": fl, "roofline_p": p},
               rel_errors(pred, target), len(t))


def fit_elementwise(target: dict[int, float]) -> Fit:
    """``a + b*T`` by least squares of the relative error over ``target``."""
    t = np.array(sorted(target), float)
    y = np.array([target[int(k)] for k in t])
    a_mat = np.vstack([np.ones_like(t), t]).T / y[:, None]
    (a, b), *_ = np.linalg.lstsq(a_mat, np.ones_like(y), rcond=None)
    pred = {int(k): a + b * k for k in t}
    return Fit("elementwise (a + b*T)", {"elementwise_s": float(a), "elementwise_s_per_token": float(b)},
               rel_errors(pred, target), len(t))


def fit_prefill_attention(points: dict[int, float] = FA3_CAUSAL_HDIM128_TFLOPS) -> Fit:
    """``F_max * k / (k + k_half)`` minimising the rms relative error over FlashAttention-3's curve."""
    k = np.array(sorted(points), float)
    y = np.array([points[int(x)] * 1e12 for x in k])
    best = None
    for half in np.arange(50.0, 3000.0, 10.0):
        shape = k / (k + half)
        fmax = float(np.sum(shape / y) / np.sum(shape ** 2 / y ** 2))  # least squares of pred/y - 1
        rms = float(np.sqrt(np.mean((fmax * shape / y - 1) ** 2)))
        if best is None or rms < best[0]:
            best = (rms, fmax, float(half))
    _, fmax, half = best
    return Fit("prefill attention (FlashAttention-3)", {"attn_prefill_flops_per_s": fmax, "attn_prefill_half_keys": half},
               np.array([fmax * x / (x + half) / v - 1 for x, v in zip(k, y)]), len(k))


def fit_decode_attention(sample: list[tuple[int, int, float]], model: gp.ModelShape, src: gp.GPU = gp.A100_SXM,
                         dst: gp.GPU = gp.H100_SXM) -> Fit:
    """``a + bytes/B`` per layer over Vidur's A100 sample (bytes: the KV the batch reads), by least
    squares of the relative error; per step (x layers) on ``dst``, B carried as the same share of
    peak bandwidth. (A per-sequence term is not fitted: in a sample of two KV lengths it is nearly
    collinear with the bytes.)"""
    byt = np.array([s[0] * s[1] * model.kv_bytes_per_token_layer for s in sample], float)
    y = np.array([s[2] / 1e3 for s in sample])
    a_mat = np.vstack([np.ones_like(y), byt]).T / y[:, None]
    (a, inv_bw), *_ = np.linalg.lstsq(a_mat, np.ones_like(y), rcond=None)
    errs = (a + byt * inv_bw) / y - 1
    share = (1 / inv_bw) / src.hbm_bytes_per_s
    return Fit("decode attention (Vidur A100 -> H100)",
               {"attn_decode_s": float(a * model.num_layers), "attn_kv_bytes_per_s": float(share * dst.hbm_bytes_per_s),
                "a100_bandwidth_share": float(share)}, errs, len(y))


def latency_steps(prompt_tokens: int, output_tokens: int, batch: int) -> list[list[tuple[int, int]]]:
    """The iterations of vLLM's latency test: one prefill of the whole batch (its first token), then
    ``output_tokens - 1`` decodes, each over the KV of the prompt and the tokens before it."""
    return ([[(prompt_tokens, 0)] * batch]
            + [[(1, prompt_tokens + k - 1)] * batch for k in range(1, output_tokens)])


def fit_overhead(profile: gp.GPUProfile) -> Fit:
    """The per-step overhead that makes the model's latency test equal vLLM's published one."""
    steps = latency_steps(**VLLM_LATENCY_SHAPE)
    zero = dataclasses.replace(profile, cost=dataclasses.replace(profile.cost, overhead_s=0.0))
    model_s = sum(zero.step_time_s(s) for s in steps)
    c0 = (VLLM_LATENCY_H100_MS / 1e3 - model_s) / len(steps)
    return Fit("overhead (vLLM latency test)", {"overhead_s": c0, "model_s": model_s}, np.array([0.0]), 1)


def fit_all(mlp: dict | None = None, decode: list | None = None) -> tuple[gp.StepCost, list[Fit], dict]:
    """Every part refit; returns the refit ``StepCost``, the fits, and the carry-over check."""
    mlp = mlp if mlp is not None else load_mlp()
    decode = decode if decode is not None else load_decode()
    prof = gp.get(PROFILE)
    l3 = prof.model
    ratios = op_ratios(LLAMA2_7B, l3)
    h100 = mlp[("h100", "Llama-2-7b-hf")]
    gemm = fit_gemm(carry(h100, GEMM_OPS, ratios, l3.num_layers), l3)
    elt = fit_elementwise(carry(h100, ELEMENTWISE_OPS, ratios, l3.num_layers, emb=True))
    pre = fit_prefill_attention()
    dec = fit_decode_attention(decode, l3)
    consts = {**gemm.constants, **elt.constants, **pre.constants,
              **{k: v for k, v in dec.constants.items() if k != "a100_bandwidth_share"}}
    cost = dataclasses.replace(prof.cost, **consts)
    over = fit_overhead(dataclasses.replace(prof, cost=cost))
    cost = dataclasses.replace(cost, overhead_s=over.constants["overhead_s"])
    check = {
        "a100": rel_errors(carry(mlp[("a100", "Llama-2-7b-hf")], LAYER_OPS, ratios, 32, emb=True),
                           measured(mlp[("a100", "Meta-Llama-3-8B")], LAYER_OPS, 32, emb=True)),
    }
    return cost, [gemm, elt, pre, dec, over], check


# ----------------------------------------------------------------------------- end-to-end checks

def sharegpt_requests(seed: int, n: int = VLLM_THROUGHPUT_PROMPTS, traces: Path | None = None):
    """``n`` (prompt, output) pairs of ShareGPT V3 first turns, vLLM's benchmark filter, drawn with ``seed``."""
    from batch.sim import traces as tr
    path = tr.traces_dir(traces) / SHAREGPT
    pairs = []
    with path.open() as f:
        for r in csv.DictReader(f):
            p, o = int(r["prompt_tokens"]), int(r["output_tokens"])
            if p >= 4 and o >= 4 and p <= 1024 and p + o <= 2048:
                pairs.append((p, o))
    return random.Random(seed).sample(pairs, n)


def throughput_check(seeds: Sequence[int], traces: Path | None = None) -> list[tuple[str, list[float]]]:
    """Requests/s of the throughput test on this clock, per seed: vLLM's scheduler (if it imports)
    at its LLM-class defaults, and Batch with the same limits."""
    import vllm_compare as vc
    clock = dataclasses.replace(vc.clock_for(PROFILE), max_num_batched_tokens=VLLM_LLM_CLASS_MAX_NUM_BATCHED_TOKENS,
                                max_num_seqs=VLLM_LLM_CLASS_MAX_NUM_SEQS)
    out = []
    runners = [("Batch", lambda r: vc.run_batch(r, clock=clock, chunk_tokens=clock.max_num_batched_tokens))]
    try:
        vc._vllm()
        runners.insert(0, ("vLLM", lambda r: vc.run_vllm(r, clock=clock, threshold=0)))
    except vc.VLLMUnavailable:
        pass
    for name, run in runners:
        rates = []
        for seed in seeds:
            reqs = [vc.TraceRequest(f"s{i}", "u1", 0.0, p, o) for i, (p, o) in enumerate(sharegpt_requests(seed, traces=traces))]
            timings = run(reqs).timings
            rates.append(len(timings) / max(t.done_s for t in timings))
        out.append((name, rates))
    return out


# ----------------------------------------------------------------------------- report

def _sig(x: float) -> str:
    return f"{x:.3g}"


def report(seeds: Sequence[int], traces: Path | None) -> tuple[str, bool]:
    """The markdown report and whether every committed constant matches its refit."""
    prof = gp.get(PROFILE)
    cost, fits, check = fit_all()
    lines = [f"GPU step-cost calibration, profile `{PROFILE}`: {prof.describe()}", ""]
    lines += ["| part | fitted to | points | rms error | worst error |", "|---|---|---|---|---|"]
    src = {"GEMMs (soft roofline)": "Vidur H100 Llama-2-7B GEMMs carried to Llama-3-8B",
           "elementwise (a + b*T)": "Vidur H100 Llama-2-7B norms, rotary, act, add, embedding carried",
           "prefill attention (FlashAttention-3)": "FlashAttention-3 H100 fwd, hdim 128, causal (arXiv:2407.08608 Fig. 5)",
           "decode attention (Vidur A100 -> H100)": "Vidur A100 Llama-3-8B decode attention sample",
           "overhead (vLLM latency test)": "vLLM H100 latency_llama8B_tp1 (997.542 ms)"}
    for f in fits:
        lines.append(f"| {f.name} | {src[f.name]} | {f.points} | {f.rms() * 100:.1f}% | {f.worst() * 100:.1f}% |")
    a = check["a100"]
    lines += ["", f"Carry-over check (Llama-2-7B -> Llama-3-8B, operator by operator, where both were measured): "
                  f"Vidur's A100 Llama-2-7B profile carried predicts its A100 Llama-3-8B profile with mean error "
                  f"{np.mean(a) * 100:+.1f}%, rms {np.sqrt(np.mean(a ** 2)) * 100:.1f}%, worst {np.max(np.abs(a)) * 100:.1f}% "
                  f"over {len(a)} token counts (1..4096).", ""]
    lines += ["| constant | committed | refit | refit / roofline |", "|---|---|---|---|"]
    ok = True
    peak = {"gemm_bytes_per_s": prof.gpu.hbm_bytes_per_s, "gemm_flops_per_s": prof.gpu.peak_flops,
            "attn_prefill_flops_per_s": prof.gpu.peak_flops, "attn_kv_bytes_per_s": prof.gpu.hbm_bytes_per_s}
    for fld in dataclasses.fields(gp.StepCost):
        have, want = getattr(prof.cost, fld.name), getattr(cost, fld.name)
        same = math.isclose(have, want, rel_tol=TOLERANCE, abs_tol=1e-7)
        ok &= same
        share = f"{want / peak[fld.name] * 100:.0f}% of {peak[fld.name]:.3g}" if fld.name in peak else ""
        lines.append(f"| `{fld.name}` | {_sig(have)} | {_sig(want)}{'' if same else ' (DIFFERS)'} | {share} |")
    # the latency test with the committed constants, and its parts
    steps = latency_steps(**VLLM_LATENCY_SHAPE)
    lat = sum(prof.step_time_s(s) for s in steps)
    dec = prof.breakdown(steps[1])
    lines += ["", "Published end-to-end figures (vLLM performance benchmark, H100, Llama-3.1-8B bf16, tensor parallel 1):", "",
              "| figure | published | this model | error | used by the fit |", "|---|---|---|---|---|",
              f"| latency: 32 in, 128 out, batch 8 (ms) | {VLLM_LATENCY_H100_MS:.1f} | {lat * 1e3:.1f} | "
              f"{(lat * 1e3 / VLLM_LATENCY_H100_MS - 1) * 100:+.1f}% | yes (it sets the overhead) |"]
    if seeds:
        for name, rates in throughput_check(seeds, traces):
            m = statistics.mean(rates)
            lines.append(f"| throughput: 200 ShareGPT prompts at once (req/s), {name}'s scheduler, {len(rates)} draws "
                         f"(min..max) | {VLLM_THROUGHPUT_H100_REQ_S:.2f} | {m:.2f} ({min(rates):.2f}..{max(rates):.2f}) | "
                         f"{(m / VLLM_THROUGHPUT_H100_REQ_S - 1) * 100:+.1f}% | no |")
    lines += ["", "One decode step of the latency test (batch 8, ~100 tokens of KV each), by part (ms): "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in dec.items()), ""]
    lines.append("Step time against the work (ms): " + "; ".join(
        f"{label} {prof.step_time_s(items) * 1e3:.1f}" for label, items in (
            ("1 decode @1k KV", [(1, 1024)]), ("64 decodes @1k", [(1, 1024)] * 64),
            ("256 decodes @1k", [(1, 1024)] * 256), ("a 64-token chunk", [(64, 0)]),
            ("a 2048-token chunk", [(2048, 0)]), ("an 8192-token chunk", [(8192, 0)]),
            ("a 2048-token chunk after 8k cached", [(2048, 8192)]))))
    return "\n".join(lines), ok


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--extract", metavar="VIDUR_REPO", help="rewrite bench/data/vidur_mlp_tp1.csv from a Vidur "
                                                            "checkout or bare git directory, then exit")
    p.add_argument("--seeds", type=int, default=5, help="draws of the 200 ShareGPT prompts for the throughput check "
                                                        "(default 5; 0 skips it)")
    p.add_argument("--traces", default=None, help="the traces folder (default: $BATCH_TRACES_DIR, else data/traces in the repository)")
    a = p.parse_args(argv)
    if a.extract:
        print(f"wrote {extract(Path(a.extract))} rows to {MLP_CSV.relative_to(ROOT)}")
        return 0
    text, ok = report(range(a.seeds), a.traces)
    print(text)
    if not ok:
        print(f"\ngpu_calibration: a committed constant of batch/sim/gpu_profile.py differs from its refit by more "
              f"than {TOLERANCE:.0%}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
