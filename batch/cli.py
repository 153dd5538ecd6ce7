"""The main job: push a workload through Batch on the simulated GPU and print metrics.

    python -m batch                                      # 50 requests of request_gen.stream, real-time stub
    python -m batch --trace norm_azure2023_conv.csv --limit 2000 --kv-cap-blocks 1024
    python -m batch --clock virtual --n 10000 --rate 40
    python -m batch --backend model                      # a tiny seeded Llama on the paged KV cache
    python -m batch --backend model --model PATH         # a local Hugging Face checkpoint directory
    python -m batch --policy fcfs --json                 # FCFS admission; one JSON object of the metrics
    python -m batch --trace mooncake_conversation_trace.jsonl --limit 400 --kv-cap-blocks 2048
                                                         # a Mooncake trace, prefix caching on (its default)
    python -m batch --gpu h100-llama3-8b --trace mooncake_conversation_trace.jsonl --limit 400
                                                         # on an H100's clock with vLLM's limits for it

Installed, the same command is ``batch-sim``. A ``--trace`` given by file name is looked up in
``--trace-dir``, else ``$BATCH_TRACES_DIR``, else ``data/traces`` in the checkout
(``batch.sim.traces``). The replay, the metrics table and the JSON are ``batch.sim.simulate``'s.

Prefix caching (``Scheduler(prefix_caching=True)``, ``docs/prefix-caching.md``) is on by default for
a Mooncake ``.jsonl`` trace, whose prompts share prefixes (``hash_ids``), and off otherwise, as
``Scheduler()`` ships; ``--prefix-caching`` / ``--no-prefix-caching`` choose. A Mooncake prompt is
about 7,000 tokens: give it a cache that fits (``--kv-cap-blocks 2048``); the default stays 256.

``--gpu NAME`` replaces the stub's clock (5 ms + 1 ms per request an iteration) with a real
deployment's (``batch.sim.gpu_profile``: Llama-3-8B in bf16 on one H100 for ``h100-llama3-8b``): an
iteration costs what its prefill tokens, decode sequences and KV reads cost there, and the KV cache,
token budget and most resident requests default to vLLM's for that GPU (28,094 blocks, 8,192 tokens,
1,024 requests). The clock is then virtual unless ``--clock real`` asks for sleeps.

A run that lasts more than 2 s shows a progress bar of finished requests on stderr when stderr is
a terminal. A bad argument is one ``batch: error: ...`` line on stderr and exit status 2 (``--help``
has the usage); a workload with no requests (``--n 0``, ``--limit 0``) prints ``batch: nothing to
run: ...`` on stderr and exits 0.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from typing import Callable, NoReturn, Sequence

import inference_stub
import request_gen
from batch.core import goodput
from batch.sim import gpu_profile, traces
from batch.sim.simulate import (DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, POLICIES, format_metrics, json_metrics,
                                run_workload)
from batch.version import version
from scheduler import Scheduler


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


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``PROG: error: MESSAGE``, on stderr with exit
    status 2: no usage block before it (``--help`` prints the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None, prog: str = "batch") -> int:
    """Command-line entry point; returns the process exit status (0 also when there was nothing
    to run: ``--n 0``, ``--limit 0``, a trace without rows).

    A reader that closes the output early (``python -m batch | head``) ends the run quietly with
    status 0, as other command-line tools do, not with a ``BrokenPipeError`` traceback.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        prog: the program's name in ``--help`` and in error lines (``batch-llm sim`` names the
            subcommand).

    Raises:
        SystemExit: status 2 with one ``batch: error: ...`` line on stderr and nothing else for a
            bad argument: an unknown option or a bad value; a ``--trace`` that is missing, a
            directory, unreadable, or has a malformed row (a non-number, a nan / inf / negative
            ``arrival_s``, a token count < 1: no request could have it); a ``--model`` that is not a checkpoint directory; a ``--device`` that
            is not a torch device name or that this machine lacks; ``--backend model`` without
            the ``model`` extra.
    """
    try:
        return _main(argv, prog)
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: Sequence[str] | None, prog: str) -> int:
    p = OneLineErrorParser(prog=prog, description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", help="a normalised trace CSV or a Mooncake .jsonl (path, or a file name in the "
                                   "traces folder)")
    p.add_argument("--trace-dir", default=None,
                   help=f"the traces folder a bare --trace name is looked up in (default ${traces.TRACES_ENV}, "
                        "else data/traces in the checkout)")
    p.add_argument("--limit", type=_count(0), default=None,
                   help="first N trace rows only (0: nothing to run, exit 0)")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="multiply trace arrival offsets by this")
    p.add_argument("--users", type=_count(1), default=5, help="users to spread a trace's requests over (traces have none)")
    p.add_argument("--n", type=_count(0), default=50,
                   help="requests from request_gen.stream (default 50; 0: nothing to run, exit 0)")
    p.add_argument("--rate", type=_positive_float, default=5.0, help="stream arrival rate, requests/s (default 5)")
    p.add_argument("--seed", type=int, default=42, help="workload seed (default 42)")
    p.add_argument("--clock", choices=("real", "virtual"), default=None,
                   help="real: the stub sleeps (default for stream); virtual: simulated time (default for traces)")
    p.add_argument("--gpu-seed", type=int, default=0, help="seeded token streams per request (default 0)")
    p.add_argument("--eos-probability", type=_probability, default=None,
                   help="chance of an early EOS per token (default 0.02 for stream; 0 for traces, so each "
                        "request runs to its recorded output length)")
    p.add_argument("--kv-cap-blocks", type=_count(1), default=None, help="KV cache size in blocks (default 256)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share full prompt blocks by content (default: on for a Mooncake .jsonl trace, "
                        "off otherwise); the metrics then carry the prefix-cache hit rate")
    p.add_argument("--max-running", type=_count(1), default=None, help="most resident requests (default 256)")
    p.add_argument("--token-budget", type=_count(1), default=None, help="tokens per iteration (default: cache size)")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                   help="print the version (pyproject.toml's) and exit")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bar (shown on stderr, when it is a terminal, once a run lasts 2 s)")
    p.add_argument("--gpu", choices=("stub", *gpu_profile.names()), default="stub",
                   help="the simulated GPU's clock: stub (5 ms + 1 ms per request an iteration, the default) or a "
                        "deployment's step cost (h100-llama3-8b: Llama-3-8B bf16 on one H100, with vLLM's limits "
                        "for it as the defaults of --kv-cap-blocks, --token-budget, --max-running)")
    p.add_argument("--backend", choices=("stub", "model"), default="stub",
                   help="stub: the simulated GPU (default); model: a Hugging Face Llama-family model on a paged "
                        "KV cache (needs the 'model' extra; real clock)")
    p.add_argument("--model", default=None, help="with --backend model: a local checkpoint directory "
                                                 "(default: a tiny seeded Llama, 2 layers, hidden 64)")
    p.add_argument("--device", default=None, help="with --backend model: torch device (default: cuda if present)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"),
                   help="with --backend model: model and KV cache dtype (default float32)")
    p.add_argument("--policy", choices=tuple(POLICIES), default="vtc",
                   help="admission and victim policy: " + "; ".join(f"{k}: {v[2]}" for k, v in POLICIES.items()))
    p.add_argument("--json", action="store_true",
                   help="print one JSON object of the metrics (vLLM benchmark_serving's names: mean_ttft_ms, "
                        "p99_tpot_ms, request_throughput, request_goodput, ...) and nothing else on stdout")
    p.add_argument("--slo-ttft-ms", type=_positive_float, default=DEFAULT_SLO_TTFT_MS,
                   help=f"goodput SLO on time to first token, ms (default {DEFAULT_SLO_TTFT_MS:g})")
    p.add_argument("--slo-tpot-ms", type=_positive_float, default=DEFAULT_SLO_TPOT_MS,
                   help=f"goodput SLO on time per output token after the first, ms (default {DEFAULT_SLO_TPOT_MS:g})")
    p.add_argument("--slo-e2el-ms", type=_positive_float, default=None,
                   help="goodput SLO on end-to-end latency, ms (default: none)")
    a = p.parse_args(argv)
    if a.backend == "model" and a.clock == "virtual":
        p.error("--backend model runs on the real clock (its iteration time is the model's)")
    gpu = None if a.gpu == "stub" else a.gpu
    if gpu and a.backend == "model":
        p.error(f"--gpu {a.gpu} prices the simulated GPU's iterations; --backend model runs a real one (drop one)")
    if gpu and a.policy == "static":
        p.error("--policy static pads batches through the stub's forward; it runs on --gpu stub only")
    sched_cls, make_policy, _ = POLICIES[a.policy]
    if a.backend == "model" and sched_cls is not Scheduler:
        p.error(f"--policy {a.policy} runs on the stub backend only (with --backend model: "
                f"{', '.join(k for k, v in POLICIES.items() if v[0] is Scheduler)})")
    slo = goodput.SLO(ttft_s=a.slo_ttft_ms / 1e3, tpot_s=a.slo_tpot_ms / 1e3,
                      e2el_s=None if a.slo_e2el_ms is None else a.slo_e2el_ms / 1e3)
    out = (lambda *args: None) if a.json else functools.partial(print, flush=True)  # --json: the JSON object only

    if a.trace:
        try:
            reqs = traces.load_trace(a.trace, limit=a.limit, time_scale=a.time_scale, users=a.users, seed=a.seed,
                                     trace_dir=a.trace_dir)
        except (FileNotFoundError, IsADirectoryError, PermissionError, ValueError) as e:
            p.error(str(e))  # no such trace, a directory, unreadable, or a malformed row / arrival
        label = f"trace {a.trace} ({len(reqs)} requests, time scale {a.time_scale})"
    else:
        reqs = request_gen.stream(n=a.n, lam=a.rate, seed=a.seed)
        label = f"request_gen.stream(n={a.n}, lam={a.rate}, seed={a.seed})"
    if not reqs:
        why = ("--n 0 asks for no requests" if not a.trace else
               "--limit 0 asks for no trace rows" if a.limit == 0 else f"trace {a.trace} has no rows")
        print(f"{prog}: nothing to run: {why}", file=sys.stderr)
        return 0
    virtual = (a.clock or ("virtual" if a.trace or gpu else "real")) == "virtual"
    kw = {k: v for k, v in (("kv_cap_blocks", a.kv_cap_blocks), ("max_running", a.max_running),
                            ("token_budget_tokens", a.token_budget)) if v is not None}
    prefix = a.prefix_caching if a.prefix_caching is not None else bool(a.trace and a.trace.endswith(".jsonl"))
    if prefix:
        if sched_cls is not Scheduler:
            p.error(f"--prefix-caching needs a policy of Scheduler (--policy {a.policy} is {sched_cls.__name__}); "
                    f"pass --no-prefix-caching")
        kw["prefix_caching"] = True
    eos_p = a.eos_probability if a.eos_probability is not None else (0.0 if a.trace else
                                                                      inference_stub.EOS_PROBABILITY)
    # a bar on a terminal only, and only once the run has lasted simulate.PROGRESS_DELAY_S
    progress = not a.no_progress and sys.stderr.isatty()
    if a.backend == "model":
        try:
            from batch.backends import model_backend  # the optional 'model' extra
        except ImportError as e:
            p.error(f"--backend model needs the 'model' extra (pip install -e '.[model]'): {e}")
        try:
            backend = model_backend.from_cli(path=a.model, device=a.device, dtype=a.dtype,
                                             num_blocks=kw.pop("kv_cap_blocks", 256))
        except (FileNotFoundError, model_backend.DeviceError) as e:  # --model nowhere, --device absent
            p.error(str(e))
        make = backend.make_scheduler
        if make_policy is not None:
            make = lambda **k: backend.make_scheduler(policy=make_policy(), **k)  # noqa: E731
        label += f", model backend: {backend.describe()}"
        out(f"Batch on {label}")  # before the run, which takes seconds: what is running
        res = run_workload(reqs, make_scheduler=make, virtual=False, progress=progress, **kw)
        virtual = False
    else:
        make = sched_cls if make_policy is None else lambda **k: sched_cls(policy=make_policy(), **k)
        if gpu:
            label += f", GPU {gpu_profile.get(gpu).describe()}"
        out(f"Batch on {label}")
        res = run_workload(reqs, make_scheduler=make, virtual=virtual, gpu_seed=a.gpu_seed, eos_probability=eos_p,
                           progress=progress, gpu=gpu, **kw)
    s = res.scheduler
    m = s.metrics()
    good = goodput.good_requests(res.completed(), slo)
    if a.json:
        print(json.dumps(json_metrics(m, res, slo=slo, good=good, policy=a.policy,
                                      policy_class=type(s.policy).__name__, scheduler_class=type(s).__name__,
                                      backend=a.backend, gpu=a.gpu, clock="virtual" if virtual else "real",
                                      workload=label),
                         indent=2))
        return 0
    out(f"clock: {'virtual' if virtual else 'real-time ' + a.backend}"
        f"{'' if gpu is None or a.backend == 'model' else ', GPU ' + gpu}; KV cap {s.config.kv_cap_blocks} blocks x "
        f"{s.config.block_tokens} tokens; prefill chunk {s.config.prefill_chunk_tokens}; policy {s.policy.name} "
        f"(--policy {a.policy})")
    out(format_metrics(m, res, slo=slo, good=good))
    if res.refused:
        r, e = res.refused[0]
        out(f"first refusal: {r.request_id}: {type(e).__name__}: {e}")
    return 0
