"""``batch-llm serve``: build the engine, tokenizer and app from the command line; run uvicorn.

    batch-llm serve --port 8000                              # the simulated GPU in real time
    batch-llm serve --time-scale 0.05                        # twenty times faster (tests, benchmarks)
    batch-llm serve --model PATH                             # a Hugging Face checkpoint folder
    batch-llm serve --config users.toml                      # per-user weights, API keys (authentication)
    batch-llm serve --trust-user-field                       # no keys: the body's user is the identity
    batch-llm serve --user-header x-tenant-id                # no keys: a trusted gateway's header
    batch-llm serve --replicas 2                             # two engines on Ray Serve (the scaleout extra)

The config file (JSON, or TOML when its name ends in ``.toml``) has two optional tables:
``weights`` (user -> int weight >= 1, passed to ``VTCPolicy``) and ``api_keys`` (API key ->
user name). With ``api_keys``, every ``/v1`` request needs one of the keys (else 401) and the
key's user is the request's fairness identity, whatever the body's ``user`` says; without keys,
every request shares the identity ``anonymous`` unless ``--trust-user-field`` (the body's
``user``) or ``--user-header NAME`` (a trusted gateway's header) says otherwise
(``batch.server.auth``; ``docs/server.md``, "Who is who")::

    [weights]
    alice = 2
    [api_keys]
    "sk-alice-1" = "alice"
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import inference_stub
from batch.policies.policy import FCFSPolicy
from batch.policies.roundrobin import RoundRobinPolicy
from batch.policies.vtc import VTCPolicy
from batch.server.auth import Identities, KeyRing
from batch.server.engine import Engine, SeededGPU
from batch.server.limits import DEFAULT_LIMIT_CONCURRENCY, FD_RESERVE, HttpLimits, raise_open_files_limit
from batch.server.tokenizer import ByteTokenizer, Tokenizer, WordTokenizer
from scheduler import Scheduler

__all__ = ["UserConfig", "load_config", "build_engine", "main"]

#: Per-request latencies the server's scheduler keeps for its own summary (``MetricsRecorder``'s
#: ``max_samples``): a window, so memory does not grow with the requests served; ``/metrics``
#: exports Prometheus histograms over every request.
LATENCY_SAMPLES = 10_000
POLICIES = ("vtc", "fcfs", "round-robin")


@dataclass
class UserConfig:
    """Per-user settings from the config file.

    Attributes:
        weights: user -> weight (int >= 1) for ``VTCPolicy``.
        api_keys: API key -> user name.
    """

    weights: dict[str, int]
    api_keys: dict[str, str]


def load_config(path: str | Path | None) -> UserConfig:
    """Read a config file: JSON, or TOML (``tomllib``) when the name ends in ``.toml``.

    Raises:
        ValueError: unreadable, not JSON/TOML, an unknown top-level key, a weight that is not
            an int >= 1, or an API key or user that is not a non-empty string; the message
            names the file and the entry.
        FileNotFoundError: no such file.
    """
    if path is None:
        return UserConfig({}, {})
    p = Path(path)
    text = p.read_bytes()
    try:
        data = tomllib.loads(text.decode()) if p.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict) or set(data) - {"weights", "api_keys"}:
        raise ValueError(f"{p}: expected an object with 'weights' and/or 'api_keys', got keys "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    weights, keys = data.get("weights", {}), data.get("api_keys", {})
    if not isinstance(weights, dict) or not isinstance(keys, dict):
        raise ValueError(f"{p}: 'weights' and 'api_keys' must be tables (objects)")
    for u, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"{p}: weight of user {u!r} must be an int >= 1, got {w!r}")
    for k, u in keys.items():
        if not (isinstance(k, str) and k and isinstance(u, str) and u):
            raise ValueError(f"{p}: api_keys entry {k!r} = {u!r}: both must be non-empty strings")
    return UserConfig(dict(weights), dict(keys))


def build_engine(*, backend: str = "sim", model: str | None = None, time_scale: float = 1.0, seed: int = 0,
                 eos_probability: float = inference_stub.EOS_PROBABILITY, policy: str = "vtc",
                 weights: dict[str, int] | None = None, kv_cap_blocks: int | None = None,
                 max_running: int | None = None, device: str | None = None, dtype: str = "float32",
                 check_invariants: bool | None = None, prefix_caching: bool = False,
                 production_checks: bool = True) -> tuple[Engine, Tokenizer, str]:
    """The engine (scheduler + backend) and tokenizer ``batch-llm serve`` runs.

    Args:
        backend: ``"sim"`` (``SeededGPU``, real time times ``time_scale``, ``WordTokenizer``)
            or ``"model"`` (``model_backend``: the checkpoint at ``model`` with its own
            tokenizer, or with ``model=None`` the tiny seeded Llama with ``ByteTokenizer``).
        time_scale: the simulated GPU's latency factor (> 0; sim only).
        seed, eos_probability: the simulated GPU's token seed and early-EOS chance.
        policy: ``vtc`` (with ``weights``), ``fcfs`` or ``round-robin``.
        kv_cap_blocks, max_running: scheduler knobs (defaults: the stub's 256 blocks, 256).
        device, dtype: the model backend's.
        check_invariants: evaluate the spec invariants around every tick (slow); ``None`` follows
            ``Scheduler``'s default (``scheduler.CHECK_INVARIANTS``, which ``tests/conftest.py`` turns
            on, so every server test runs checked).
        production_checks: the cheap subset (``Scheduler(production_checks=True)``: the KV cap before
            ``forward``, the ledger, reference counts; O(batch) per tick), on by default: a violation is
            logged and counted in ``/metrics``, and a plan past the cap never reaches the backend.
        prefix_caching: share full prompt blocks by content (``Scheduler(prefix_caching=True)``):
            every tokenizer here gives a shared text prefix (a system prompt) the same leading
            ids, so a repeated one hits; ``/metrics`` counts ``batch:prefix_cache_hits`` / ``_queries``.

    Returns:
        ``(engine, tokenizer, model_name)``.

    Raises:
        ValueError: a bad knob (the message names it); ``weights`` with a policy other than vtc.
        FileNotFoundError: ``model`` is not a checkpoint folder.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if weights and policy != "vtc":
        raise ValueError("per-user weights need --policy vtc")
    pol = VTCPolicy(weights=weights or {}) if policy == "vtc" else (
        FCFSPolicy() if policy == "fcfs" else RoundRobinPolicy())
    kw: dict[str, Any] = {"policy": pol, "record_itl": False, "check_invariants": check_invariants,
                          "production_checks": production_checks,
                          "max_latency_samples": LATENCY_SAMPLES,  # /metrics has its own histograms
                          "max_backend_tries": 3,  # a failing backend fails its batch, not the server
                          "prefix_caching": prefix_caching}
    if max_running is not None:
        kw["max_running"] = max_running
    if backend == "sim":
        gpu = SeededGPU(time_scale=time_scale, seed=seed, eos_probability=eos_probability)
        if kv_cap_blocks is not None:
            kw["kv_cap_blocks"] = kv_cap_blocks
        sched = Scheduler(backend=gpu, **kw)
        return Engine(sched), WordTokenizer(sched.config.eos_token_id), "batch-sim"
    if backend != "model":
        raise ValueError(f"backend must be 'sim' or 'model', got {backend!r}")
    from batch.backends import model_backend  # the optional 'model' extra

    mb = model_backend.from_cli(path=model, device=device, dtype=dtype,
                                num_blocks=kv_cap_blocks or inference_stub.MAX_KV_BLOCKS)
    sched = mb.make_scheduler(**kw)
    if model is None:
        return Engine(sched), ByteTokenizer(mb.eos_token_id), "tiny-llama"
    from batch.server.tokenizer import HFTokenizer

    return Engine(sched), HFTokenizer(model), Path(model).name


def _positive_float(text: str) -> float:
    v = float(text)
    if not 0 < v < math.inf:
        raise ValueError(text)
    return v


_positive_float.__name__ = "finite number > 0"


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not 0 <= v < math.inf:
        raise ValueError(text)
    return v


_non_negative_float.__name__ = "finite number >= 0"


#: ``batch-llm serve`` options the Ray deployment does not honour: refused with ``--replicas N > 1``
#: when set to anything but their default (rather than silently ignored).
_NOT_WITH_REPLICAS = ("max_running", "max_waiting", "prefix_caching", "served_model_name", "max_user_labels",
                      "log_level", "device", "dtype", "timeout_headers", "limit_concurrency",
                      "h11_max_incomplete_event_size", "h11_max_header_count", "metrics_min_interval")


def _serve_replicas(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--replicas N`` with N > 1: Ray Serve (``batch.scaleout.ray_serve.serve_http``)."""
    if a.model or a.backend == "model" or a.policy != "vtc":
        p.error("--replicas N > 1 serves the simulated GPU with the VTC policy only")
    unsupported = [f"--{k.replace('_', '-')}" for k in _NOT_WITH_REPLICAS if getattr(a, k) != p.get_default(k)]
    if a.max_body_bytes < 1:
        p.error(f"--max-body-bytes must be >= 1, got {a.max_body_bytes}")
    if a.kv_cap_blocks is not None and a.kv_cap_blocks < 1:
        p.error(f"--kv-cap-blocks must be >= 1, got {a.kv_cap_blocks}")
    if unsupported:
        p.error(f"--replicas N > 1 does not support {', '.join(unsupported)} (docs/scale-out.md, section 4)")
    try:
        users = load_config(a.config)
        identities = Identities(users.api_keys, trust_user_field=a.trust_user_field, user_header=a.user_header)
        if a.metrics_auth and not users.api_keys:
            raise ValueError("--metrics-auth needs the config's api_keys: there is no key to ask for")
        if not a.timeout_keep_alive > 0:
            raise ValueError(f"--timeout-keep-alive must be > 0, got {a.timeout_keep_alive}")
    except (ValueError, FileNotFoundError, OSError) as e:
        p.error(str(e))
    try:
        from batch.scaleout.ray_serve import serve_http  # the optional 'scaleout' extra
    except ImportError as e:
        print(f"batch-llm serve --replicas needs the 'scaleout' extra (pip install -e '.[scaleout]'): {e}",
              file=sys.stderr)
        return 2
    print(f"batch-llm serve: {a.replicas} replicas on Ray Serve (sim, time scale {a.time_scale}, counters synced every "
          f"{a.counter_period} s, identity: {identities.mode}) on http://{a.host}:{a.port}/v1/completions",
          file=sys.stderr)
    try:
        serve_http(a.replicas, host=a.host, port=a.port, time_scale=a.time_scale, seed=a.seed,
                   eos_probability=a.eos_probability, period_s=a.counter_period, weights=users.weights,
                   kv_cap_blocks=a.kv_cap_blocks,
                   max_body_bytes=a.max_body_bytes, api_keys=users.api_keys, trust_user_field=a.trust_user_field,
                   user_header=a.user_header, metrics_need_key=a.metrics_auth, shutdown_timeout_s=a.shutdown_timeout,
                   timeout_keep_alive_s=a.timeout_keep_alive, auth_failure_delay_s=a.auth_failure_delay)
    except KeyboardInterrupt:
        return 130
    return 0


def _log_to_stderr(level: str) -> None:
    """The ``batch`` loggers (e.g. a client that closed mid-body) to stderr, one line a record."""
    logger = logging.getLogger("batch")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:  %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def main(argv: Sequence[str] | None = None) -> int:
    """``batch-llm serve``: parse arguments, build, run uvicorn until interrupted; the exit status.

    Raises:
        SystemExit: status 2 with a ``batch-llm serve: error: ...`` line for a bad argument or
            config file.
    """
    p = argparse.ArgumentParser(prog="batch-llm serve", description="An OpenAI-compatible HTTP server over Batch.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="a Hugging Face checkpoint folder (implies --backend model)")
    p.add_argument("--backend", choices=("sim", "model"), default=None,
                   help="sim: the simulated GPU in real time (default); model: --model, or the tiny seeded Llama")
    p.add_argument("--time-scale", type=_positive_float, default=1.0,
                   help="the simulated GPU's iteration latency factor (default 1: 5 ms + 1 ms per request)")
    p.add_argument("--seed", type=int, default=0, help="the simulated GPU's token seed (default 0)")
    p.add_argument("--eos-probability", type=float, default=inference_stub.EOS_PROBABILITY,
                   help="the simulated GPU's early-EOS chance per token (default 0.02)")
    p.add_argument("--policy", choices=POLICIES, default="vtc")
    p.add_argument("--config", default=None, help="per-user weights and API keys (JSON, or TOML by .toml)")
    p.add_argument("--kv-cap-blocks", type=int, default=None, help="KV cache blocks (default 256)")
    p.add_argument("--max-running", type=int, default=None, help="most resident requests (default 256)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="share full prompt blocks by content, so a repeated system prompt is not computed again "
                        "(default off, as Scheduler(); docs/prefix-caching.md)")
    p.add_argument("--max-waiting", type=int, default=2048,
                   help="most requests waiting for their first token; more get 429 (default 2048)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body; a larger one gets 413 (default 4 MiB)")
    p.add_argument("--trust-user-field", action="store_true",
                   help="without api_keys: the body's 'user' is the fairness identity, for a trusted front end that "
                        "sets it (default: every request without a key shares the identity 'anonymous')")
    p.add_argument("--user-header", default=None, metavar="NAME",
                   help="without api_keys: the fairness identity is this request header's value, set by a trusted "
                        "gateway (e.g. x-tenant-id); clients must not be able to reach the server but through it")
    p.add_argument("--metrics-auth", action=argparse.BooleanOptionalAction, default=None,
                   help="/metrics needs one of the config's API keys too (default: yes when the config has "
                        "api_keys, else open as /health; --no-metrics-auth opens it for a scraper inside the network)")
    p.add_argument("--metrics-min-interval", type=_non_negative_float, default=0.1,
                   help="seconds between two /metrics renders; each scrape gets a render begun after it arrived, "
                        "concurrent scrapes share one (default 0.1)")
    p.add_argument("--auth-failure-delay", type=_non_negative_float, default=0.1,
                   help="seconds before a 401 is answered: a client trying made-up keys gets at most 1/DELAY "
                        "answers a second per connection (default 0.1)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc nor /openapi.json (always off when the config has api_keys)")
    p.add_argument("--max-user-labels", type=int, default=100,
                   help="users (the config's included) that get their own per-user metric label; later ones "
                        "are counted as user=\"other\" (default 100)")
    g = p.add_argument_group("connection limits (docs/server.md, \"Connections\")")
    g.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0,
                   help="seconds an idle keep-alive connection is kept after a response (default 5, uvicorn's)")
    g.add_argument("--timeout-headers", type=_positive_float, default=10.0,
                   help="seconds a request's head (request line and headers) may take from the connection's opening "
                        "or the previous response's end; a slower one is closed (default 10)")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help=f"most connections open at once; past it the one idle longest is closed, or the new one "
                        f"refused with 503 when all are busy (default {DEFAULT_LIMIT_CONCURRENCY}, at most the "
                        f"open-files limit less {FD_RESERVE})")
    g.add_argument("--h11-max-incomplete-event-size", type=int, default=16 * 1024,
                   help="largest request head (request line and headers), bytes; a larger one gets 431 "
                        "(default 16384)")
    g.add_argument("--h11-max-header-count", type=int, default=256,
                   help="most header lines in a request; more get 431 (default 256)")
    p.add_argument("--shutdown-timeout", type=_positive_float, default=10.0,
                   help="at SIGINT/SIGTERM, seconds to wait for open responses after aborting the requests "
                        "in flight (default 10)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default=None, help="with --model: torch device")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"))
    p.add_argument("--log-level", default="warning")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas (default 1: this process, no Ray); N > 1 runs N replicas on Ray Serve with "
                        "shared per-user counters, the simulated GPU only, /v1/completions (streaming or not), /metrics "
                        "(the scaleout extra; docs/scale-out.md)")
    p.add_argument("--counter-period", type=_positive_float, default=0.05,
                   help="with --replicas N: seconds between counter syncs (default 0.05)")
    a = p.parse_args(argv)
    if a.replicas < 1:
        p.error(f"--replicas must be >= 1, got {a.replicas}")
    if a.replicas > 1:
        return _serve_replicas(p, a)
    try:
        import uvicorn  # noqa: F401 - the optional 'serve' extra: only checked for here

        from batch.server.app import ServerConfig, create_app
        from batch.server.graceful import GracefulServer
    except ImportError as e:
        print(f"batch-llm serve needs the 'serve' extra (pip install -e '.[serve]'): {e}", file=sys.stderr)
        return 2
    backend = a.backend or ("model" if a.model else "sim")
    nofile_before, nofile = raise_open_files_limit()  # each connection holds a descriptor
    try:
        users = load_config(a.config)
        keys = KeyRing(users.api_keys)  # digests only: the raw keys are dropped below
        users.api_keys.clear()
        limits = HttpLimits(timeout_keep_alive=a.timeout_keep_alive, timeout_headers=a.timeout_headers,
                            limit_concurrency=a.limit_concurrency,
                            h11_max_incomplete_event_size=a.h11_max_incomplete_event_size,
                            h11_max_header_count=a.h11_max_header_count)
        engine, tok, name = build_engine(backend=backend, model=a.model, time_scale=a.time_scale, seed=a.seed,
                                         eos_probability=a.eos_probability, policy=a.policy, weights=users.weights,
                                         kv_cap_blocks=a.kv_cap_blocks, max_running=a.max_running, device=a.device,
                                         dtype=a.dtype, prefix_caching=a.prefix_caching)
        cfg = ServerConfig(model_name=a.served_model_name or name, max_waiting=a.max_waiting,
                           api_keys=keys, seed_by_prompt=backend == "sim",
                           max_body_bytes=a.max_body_bytes, trust_user_field=a.trust_user_field,
                           user_header=a.user_header, metrics_need_key=a.metrics_auth,
                           max_user_labels=a.max_user_labels, limits=limits,
                           disable_fastapi_docs=a.disable_fastapi_docs, auth_failure_delay_s=a.auth_failure_delay,
                           metrics_min_interval_s=a.metrics_min_interval)
        app = create_app(engine, tok, cfg)
    except (ValueError, FileNotFoundError, OSError) as e:
        p.error(str(e))
    srv = app.state.server
    print(f"batch-llm serve: {cfg.model_name} ({backend}, tokenizer {tok.name}, time scale {a.time_scale}, identity: "
          f"{srv.identities.mode}{', /metrics needs a key' if srv.metrics_need_key else ''}) on "
          f"http://{a.host}:{a.port}", file=sys.stderr)
    raised = "" if nofile == nofile_before else f", raised from {nofile_before}"
    print(f"batch-llm serve: at most {app.state.guard.max_connections} connections (open-files limit {nofile}{raised}), "
          f"request head within {a.timeout_headers:g} s and {a.h11_max_incomplete_event_size} bytes, keep-alive "
          f"{a.timeout_keep_alive:g} s", file=sys.stderr)
    _log_to_stderr(a.log_level)
    config = app.state.guard.uvicorn_config(app, host=a.host, port=a.port, log_level=a.log_level, access_log=False,
                                            timeout_graceful_shutdown=a.shutdown_timeout)
    try:
        GracefulServer(config, engine).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it caught, after its clean shutdown
        return 130
    return 0
