"""The main job: push a workload through Batch on the simulated GPU and print metrics.

    python simulate.py                                   # 50 requests of request_gen.stream, real-time stub
    python simulate.py --trace norm_azure2023_conv.csv --limit 2000 --kv-cap-blocks 1024
    python simulate.py --clock virtual --n 10000 --rate 40
    python simulate.py --backend model                   # a tiny seeded Llama on the paged KV cache
    python simulate.py --backend model --model PATH      # a local Hugging Face checkpoint directory

Arrivals are replayed: each request is submitted when the clock passes its arrival offset,
between ticks, as a serving loop would. With ``--clock virtual`` the stub advances simulated
time by its latency model instead of sleeping, and idle gaps are skipped.
"""
from __future__ import annotations

import argparse
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import inference_stub
import request_gen
from inference_stub import Request, SimulatedGPU, VirtualClock
from scheduler import RequestError, Scheduler


@dataclass
class RunResult:
    """What a run produced.

    Attributes:
        scheduler: the scheduler after the run (``metrics()`` is ready).
        finished: requests that completed, in completion order.
        refused: ``(request, error)`` for each request refused at submit.
        wall_s: real seconds the run took.
        sim_s: seconds on the run's clock from the first arrival to the end.
        busy_s: seconds the GPU spent in ``forward`` (simulated GPUs only, else 0).
    """

    scheduler: Scheduler
    finished: list[Request]
    refused: list[tuple[Request, RequestError]] = field(default_factory=list)
    wall_s: float = 0.0
    sim_s: float = 0.0
    busy_s: float = 0.0


def run_workload(
    requests: Sequence[Request],
    *,
    make_scheduler: Callable[..., Scheduler] = Scheduler,
    virtual: bool = True,
    gpu_seed: int | None = 0,
    base_s: float = inference_stub.ITERATION_BASE_S,
    per_request_s: float = inference_stub.ITERATION_PER_REQUEST_S,
    eos_probability: float = inference_stub.EOS_PROBABILITY,
    progress: bool = False,
    max_ticks: int | None = None,
    **scheduler_kwargs,
) -> RunResult:
    """Replay ``requests`` (``submitted_at`` = arrival offset, seconds) through a scheduler.

    Args:
        requests: the workload; each is submitted when the clock passes its offset.
        make_scheduler: a scheduler class or factory taking keyword arguments.
        virtual: simulated time (a ``VirtualClock``) instead of real sleeps.
        gpu_seed: seeded token streams (``SimulatedGPU(seed=...)``); ``None`` for shared random.
        base_s, per_request_s, eos_probability: the simulated GPU's parameters.
        progress: show a tqdm progress bar of finished requests on stderr.
        max_ticks: stop with ``RuntimeError`` after this many ticks (a guard for tests).
        **scheduler_kwargs: passed to ``make_scheduler`` (``clock`` and ``backend`` are set here).

    Returns:
        A ``RunResult``; refused requests are counted there and in ``metrics()["refusals"]``.

    Raises:
        ValueError: a request's ``submitted_at`` is not a finite number of seconds >= 0 (nan,
            inf, negative, or not a number), naming the request; checked before anything runs
            (a nan offset made the replay wait for ever).
        RuntimeError: ``max_ticks`` ticks passed and the run has not finished.
    """
    for r in requests:
        t = r.submitted_at
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not 0 <= t < math.inf:
            raise ValueError(f"request {r.request_id!r}: submitted_at (arrival offset) must be a finite "
                             f"number of seconds >= 0, got {t!r}")
    clock = VirtualClock() if virtual else None
    now: Callable[[], float] = clock.now if clock else time.time
    gpu = SimulatedGPU(base_s=base_s, per_request_s=per_request_s, eos_probability=eos_probability,
                       seed=gpu_seed, clock=clock)
    sched = make_scheduler(clock=now, backend=gpu.forward, **scheduler_kwargs)
    pending = sorted(requests, key=lambda r: r.submitted_at)
    offsets = [r.submitted_at for r in pending]
    result = RunResult(scheduler=sched, finished=[])
    bar = None
    if progress:
        from tqdm import tqdm  # noqa: PLC0415

        bar = tqdm(total=len(pending), unit="req", file=sys.stderr, mininterval=0.5)
    wall0 = time.perf_counter()
    t0 = now()
    i, ticks = 0, 0
    while i < len(pending) or sched.has_active():
        t = now()
        while i < len(pending) and t0 + offsets[i] <= t:
            try:
                sched.submit(pending[i])
            except RequestError as e:
                result.refused.append((pending[i], e))
                if bar:
                    bar.update(1)
            i += 1
        if sched.has_active():
            done = sched.tick()
            ticks += 1
            result.finished.extend(done)
            if bar and done:
                bar.update(len(done))
            if max_ticks is not None and ticks > max_ticks:
                raise RuntimeError(f"run did not finish within {max_ticks} ticks")
        elif i < len(pending):
            if clock:
                clock.advance_to(t0 + offsets[i])
            else:
                time.sleep(max(0.0, t0 + offsets[i] - now()))
    if bar:
        bar.close()
    result.wall_s = time.perf_counter() - wall0
    result.sim_s = now() - t0
    result.busy_s = gpu.busy_s
    return result


def format_metrics(m: dict, result: RunResult | None = None) -> str:
    """A plain two-column table of the headline metrics (seconds shown in ms where small)."""
    rows = [
        ("requests finished", f"{m['requests_finished']}"),
        ("requests refused", f"{m['refusals']}" + (f"  {m['refusals_by_reason']}" if m["refusals"] else "")),
        ("output tokens", f"{m['output_tokens']}"),
        ("throughput (output tok/s)", f"{m['throughput_tokens_per_sec']:.1f}"),
        ("avg e2e latency", f"{m['avg_latency_s']:.3f} s"),
        ("p50 / p99 e2e latency", f"{m['e2e_p50_s']:.3f} / {m['p99_latency_s']:.3f} s"),
        ("TTFT mean / p50 / p99", f"{m['ttft_mean_s']*1e3:.1f} / {m['ttft_p50_s']*1e3:.1f} / {m['ttft_p99_s']*1e3:.1f} ms"),
        ("TPOT p50 / p99", f"{m['tpot_p50_s']*1e3:.1f} / {m['tpot_p99_s']*1e3:.1f} ms"),
        ("ITL p50 / p99", f"{m['itl_p50_s']*1e3:.1f} / {m['itl_p99_s']*1e3:.1f} ms"),
        ("queue time p50 / p99", f"{m['queue_p50_s']*1e3:.1f} / {m['queue_p99_s']*1e3:.1f} ms"),
        ("gpu_utilization (non-empty ticks)", f"{m['gpu_utilization']:.3f}"),
        ("avg batch (requests / tokens)", f"{m['avg_batch_requests']:.1f} / {m['avg_batch_tokens']:.1f}"),
        ("KV utilization (avg of cap)", f"{m['kv_utilization']:.3f}"),
        ("preemptions", f"{m['preemptions']}"),
        ("finish reasons", f"{m['finish_reasons']}"),
        ("Jain index (output tokens/user)", f"{m['jain_index_output_tokens']:.3f}"),
        ("ticks", f"{m['ticks']}"),
    ]
    if result is not None:
        rows.append(("clock seconds / wall seconds", f"{result.sim_s:.2f} / {result.wall_s:.2f}"))
        if result.sim_s > 0 and result.busy_s:
            rows.append(("GPU busy fraction of clock time", f"{result.busy_s / result.sim_s:.3f}"))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _count(lo: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``lo``."""
    def parse(text: str) -> int:
        v = int(text)
        if v < lo:
            raise ValueError(text)
        return v
    parse.__name__ = f"int >= {lo}"  # argparse names the type in its message
    return parse


def _positive_float(text: str) -> float:
    """An argparse type: a finite float > 0."""
    v = float(text)
    if not 0 < v < math.inf:
        raise ValueError(text)
    return v


def _probability(text: str) -> float:
    """An argparse type: a float in [0, 1]."""
    v = float(text)
    if not 0 <= v <= 1:
        raise ValueError(text)
    return v


_positive_float.__name__ = "finite number > 0"
_probability.__name__ = "probability in [0, 1]"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status.

    A reader that closes the output early (``simulate.py | head``) ends the run quietly with
    status 0, as other command-line tools do, not with a ``BrokenPipeError`` traceback.

    Raises:
        SystemExit: status 2 with one ``simulate: error: ...`` line on stderr (after the usage
            line) for a bad argument: a ``--trace`` that is missing, a directory, unreadable, or
            has a malformed row (a non-number, a nan / inf / negative ``arrival_s``); a
            ``--model`` that is not a checkpoint directory; a ``--device`` that is not a torch
            device name or that this machine lacks.
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="a normalised trace CSV (path, or a file name in ../shared/traces/)")
    p.add_argument("--limit", type=_count(0), default=None, help="first N trace rows only")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="multiply trace arrival offsets by this")
    p.add_argument("--users", type=_count(1), default=5, help="users to spread a trace's requests over (traces have none)")
    p.add_argument("--n", type=_count(0), default=50, help="requests from request_gen.stream (default 50)")
    p.add_argument("--rate", type=_positive_float, default=5.0, help="stream arrival rate, requests/s (default 5)")
    p.add_argument("--seed", type=int, default=42, help="workload seed (default 42)")
    p.add_argument("--clock", choices=("real", "virtual"), default=None,
                   help="real: the stub sleeps (default for stream); virtual: simulated time (default for traces)")
    p.add_argument("--gpu-seed", type=int, default=0, help="seeded token streams per request (default 0)")
    p.add_argument("--eos-probability", type=_probability, default=None,
                   help="chance of an early EOS per token (default 0.02 for stream; 0 for traces, so each "
                        "request runs to its recorded output length)")
    p.add_argument("--kv-cap-blocks", type=_count(1), default=None, help="KV cache size in blocks (default 256)")
    p.add_argument("--max-running", type=_count(1), default=None, help="most resident requests (default 256)")
    p.add_argument("--token-budget", type=_count(1), default=None, help="tokens per iteration (default: cache size)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--backend", choices=("stub", "model"), default="stub",
                   help="stub: the simulated GPU (default); model: a Hugging Face Llama-family model on a paged "
                        "KV cache (needs the 'model' extra; real clock)")
    p.add_argument("--model", default=None, help="with --backend model: a local checkpoint directory "
                                                 "(default: a tiny seeded Llama, 2 layers, hidden 64)")
    p.add_argument("--device", default=None, help="with --backend model: torch device (default: cuda if present)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"),
                   help="with --backend model: model and KV cache dtype (default float32)")
    a = p.parse_args(argv)
    if a.backend == "model" and a.clock == "virtual":
        p.error("--backend model runs on the real clock (its iteration time is the model's)")

    if a.trace:
        try:
            reqs = request_gen.load_trace(a.trace, limit=a.limit, time_scale=a.time_scale, users=a.users, seed=a.seed)
        except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as e:
            p.error(str(e))  # no such trace, a directory, unreadable, or a malformed row / arrival
        label = f"trace {a.trace} ({len(reqs)} requests, time scale {a.time_scale})"
    else:
        reqs = request_gen.stream(n=a.n, lam=a.rate, seed=a.seed)
        label = f"request_gen.stream(n={a.n}, lam={a.rate}, seed={a.seed})"
    virtual = (a.clock or ("virtual" if a.trace else "real")) == "virtual"
    kw = {k: v for k, v in (("kv_cap_blocks", a.kv_cap_blocks), ("max_running", a.max_running),
                            ("token_budget_tokens", a.token_budget)) if v is not None}
    eos_p = a.eos_probability if a.eos_probability is not None else (0.0 if a.trace else
                                                                      inference_stub.EOS_PROBABILITY)
    progress = not a.no_progress and len(reqs) >= 200
    if a.backend == "model":
        try:
            import model_backend  # noqa: PLC0415 - the optional 'model' extra
        except ImportError as e:
            print(f"--backend model needs the 'model' extra (pip install -e '.[model]'): {e}", file=sys.stderr)
            return 2
        try:
            backend = model_backend.from_cli(path=a.model, device=a.device, dtype=a.dtype,
                                             num_blocks=kw.pop("kv_cap_blocks", 256))
        except (FileNotFoundError, model_backend.DeviceError) as e:  # --model nowhere, --device absent
            p.error(str(e))
        res = run_workload(reqs, make_scheduler=backend.make_scheduler, virtual=False, progress=progress, **kw)
        virtual = False
        print(f"Batch on {label}, model backend: {backend.describe()}")
    else:
        res = run_workload(reqs, virtual=virtual, gpu_seed=a.gpu_seed, eos_probability=eos_p, progress=progress,
                           **kw)
        print(f"Batch on {label}")
    s = res.scheduler
    print(f"clock: {'virtual' if virtual else 'real-time ' + a.backend}; KV cap {s.kv_cap_blocks} blocks x "
          f"{s.block_tokens} tokens; prefill chunk {s.prefill_chunk_tokens}; policy {type(s.policy).__name__}")
    print(format_metrics(s.metrics(), res))
    iso = getattr(s, "isolation", None)
    if iso is not None and iso.model.ready:
        a_s, per_req_s, per_tok_s = iso.model.coefficients()
        print(f"learned iteration latency: {a_s * 1e3:.3f} ms + {per_req_s * 1e6:.1f} us/request + "
              f"{per_tok_s * 1e6:.2f} us/token ({iso.model.observations} iterations observed)")
    if res.refused:
        r, e = res.refused[0]
        print(f"first refusal: {r.request_id}: {type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
