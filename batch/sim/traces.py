"""Request traces: where they are and how they load.

``load_trace`` replays the normalised trace CSVs (``arrival_s,prompt_tokens,output_tokens,user_id``)
of the traces folder: the Azure LLM inference trace 2023 (Patel et al., Splitwise, ISCA 2024) and
the Mooncake FAST'25 traces; the anchor traces are in its ``anchors/`` folder. A ``.jsonl`` file
is read as a Mooncake trace (``load_mooncake``): ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per 512-token block of the prompt, from which the
prompt's token ids are derived so that equal ids give equal tokens (the prefix cache's hits;
``docs/prefix-caching.md``). Each file's source, licence and derivation: ``data/traces/README.md``.

A trace given by file name is looked up in the traces folder, first to last:

1. a folder passed explicitly (the main job's ``--trace-dir``, the bench scripts' ``--traces``);
2. ``$BATCH_TRACES_DIR``;
3. ``data/traces`` of the repository: the checkout the current directory is in (the nearest
   folder at or above it holding ``pyproject.toml`` and ``scheduler.py``), else the one this
   package sits in (a checkout on ``sys.path``, an editable install). A package installed
   without its repository (``pip install .``) has no traces folder: set ``$BATCH_TRACES_DIR``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
from pathlib import Path

from inference_stub import VOCAB_SIZE, Request

#: The setting that names the traces folder.
TRACES_ENV = "BATCH_TRACES_DIR"
#: The anchor traces' sub-folder (``bench/vllm_compare.py`` and the sweeps read them).
ANCHORS = "anchors"
_TOKEN_IDS = range(1, VOCAB_SIZE)
#: Tokens per Mooncake ``hash_ids`` entry (the trace's block; ``ceil(input_length / 512)`` ids a row).
MOONCAKE_BLOCK_TOKENS = 512


def project_root(start: str | os.PathLike | None = None) -> Path | None:
    """The checkout at or above ``start`` (default: the current directory): the nearest folder
    holding ``pyproject.toml`` and ``scheduler.py``; ``None`` outside one."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "scheduler.py").is_file():
            return folder
    return None


#: The traces folder inside the repository (``data/traces/README.md`` lists its files).
REPO_TRACES = Path("data") / "traces"


def default_traces_dir() -> Path:
    """``data/traces`` of the current directory's checkout, else of the checkout holding this
    package, else where it would be beside the installed package (absent: see the module
    docstring)."""
    root = project_root() or project_root(Path(__file__).parent) or Path(__file__).resolve().parents[2]
    return root / REPO_TRACES


def shown_path(path: str | os.PathLike) -> str:
    """``path`` relative to the current directory's checkout when inside it (``data/traces/anchors``),
    else as given: what a report prints, the same on every machine."""
    root = project_root()
    p = Path(path)
    if root is not None:
        try:
            return str(p.resolve().relative_to(root))
        except ValueError:
            pass
    return str(path)


def traces_dir(folder: str | os.PathLike | None = None) -> Path:
    """The traces folder: ``folder`` if given, else ``$BATCH_TRACES_DIR``, else the default."""
    if folder:
        return Path(folder)
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else default_traces_dir()


def resolve_trace(name_or_path: str | os.PathLike, trace_dir: str | os.PathLike | None = None) -> Path:
    """Path of a trace given as a path or as a file name inside the traces folder
    (``traces_dir(trace_dir)``: ``trace_dir``, else ``$BATCH_TRACES_DIR``, else the default).

    Raises:
        FileNotFoundError: neither exists.
        IsADirectoryError: the path found is a directory, not a trace file.
    """
    p = Path(name_or_path)
    q = traces_dir(trace_dir) / p
    for found in (p, q):
        if found.is_dir():
            raise IsADirectoryError(f"trace {found} is a directory, not a CSV file")
        if found.exists():
            return found
    raise FileNotFoundError(f"no trace at {p} nor {q} (traces folder: --trace-dir, else ${TRACES_ENV}, "
                            f"else {REPO_TRACES} in the checkout)")


def _numbered_rows(reader: csv.DictReader, path: str | os.PathLike, limit: int | None) -> list[tuple[int, dict]]:
    """The first ``limit`` rows (``None``: all) as ``(line number, row)``, after checking the header.

    Raises:
        ValueError: the header lacks a column ``load_trace`` needs.
    """
    need = {"arrival_s", "prompt_tokens", "output_tokens"}
    if not need <= set(reader.fieldnames or ()):
        raise ValueError(f"{path}: header must have {sorted(need)}, got {reader.fieldnames}")
    out: list[tuple[int, dict]] = []
    for row in reader:
        if limit is not None and len(out) >= limit:
            break
        out.append((reader.line_num, row))
    return out


def load_trace(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    users: int = 1,
    seed: int = 0,
    trace_dir: str | os.PathLike | None = None,
) -> list[Request]:
    """Requests from a normalised trace CSV (``arrival_s,prompt_tokens,output_tokens,user_id``;
    ``user`` is read as ``user_id`` when the file has no ``user_id`` value).

    Args:
        path: a CSV path, or a file name in the traces folder (``traces_dir(trace_dir)``).
        limit: keep only the first ``limit`` rows (``None``: all).
        time_scale: multiply every arrival offset by this (0.5 replays twice as fast).
        users: the production traces carry no user id; an empty ``user_id`` becomes
            ``u1``..``u<users>``, drawn with ``seed``. A non-empty id in the file is kept: the
            ``user_id`` column, or else a ``user`` column (the anchor traces in
            ``anchors/`` folder name it so).
        seed: seed for prompt token ids and user assignment.
        trace_dir: the traces folder a bare file name is looked up in (default: ``$BATCH_TRACES_DIR``,
            else ``data/traces`` in the checkout).

    A ``.jsonl`` file is a Mooncake trace: ``load_mooncake`` reads it (the same arguments).

    Returns:
        Requests ``t0, t1, ...`` in file order: a prompt of ``prompt_tokens`` ids in 1..63,
        ``max_tokens = output_tokens``, ``submitted_at`` = the (scaled) arrival offset, seconds.
        Rows whose prompt cannot fit the KV cache are still returned: the scheduler refuses
        them at ``submit`` with a typed error, and the runner counts them.

    Raises:
        FileNotFoundError: no such trace.
        IsADirectoryError: ``path`` is a directory.
        ValueError: a malformed row, naming the file, the line and the value: a field that is
            not a number, an ``arrival_s`` that is not finite (nan, inf) or is negative (a nan
            arrival made a replay wait for ever), or a token count < 1 (an empty prompt or no
            output token: no request could have it, ``Scheduler.submit`` refuses it); a file that
            is not UTF-8 text or not CSV; ``time_scale`` not a finite number > 0; ``users < 1``.
    """
    _check_scale_users(time_scale, users)
    found = resolve_trace(path, trace_dir)
    if found.suffix == ".jsonl":
        return load_mooncake(found, limit=limit, time_scale=time_scale, users=users, seed=seed)
    rng = random.Random(seed)
    out: list[Request] = []
    with open(found, newline="", encoding="utf-8") as f:
        try:
            rows = _numbered_rows(csv.DictReader(f), path, limit)
        except (csv.Error, UnicodeDecodeError) as e:  # a NUL byte, a binary file
            raise ValueError(f"{path}: not a CSV text file: {e}") from None
    for i, (line, row) in enumerate(rows):
        where = f"{path}: line {line}"
        try:
            arrival_s = float(row["arrival_s"])
            plen = int(row["prompt_tokens"])
            olen = int(row["output_tokens"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        if not 0 <= arrival_s < math.inf:
            raise ValueError(f"{where}: arrival_s must be a finite number of seconds >= 0, got {row['arrival_s']!r}")
        arrival_s *= time_scale
        if arrival_s == math.inf:
            raise ValueError(f"{where}: arrival_s {row['arrival_s']!r} times time_scale {time_scale} is not finite")
        if plen < 1 or olen < 1:  # Scheduler.submit refuses both: a table of zeros, not a replay
            raise ValueError(f"{where}: no request can have this row: prompt_tokens and output_tokens must be "
                             f">= 1 (a request has a prompt and asks for a token), got prompt_tokens={plen}, "
                             f"output_tokens={olen}")
        user = (row.get("user_id") or row.get("user") or "").strip() or f"u{rng.randint(1, users)}"
        out.append(
            Request(
                user_id=user,
                prompt=rng.choices(_TOKEN_IDS, k=plen),
                max_tokens=olen,
                request_id=f"t{i}",
                submitted_at=arrival_s,
            )
        )
    return out


def _check_scale_users(time_scale: float, users: int) -> None:
    if not 0 < time_scale < math.inf:
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    if users < 1:
        raise ValueError(f"users must be >= 1, got {users}")


def block_token_ids(hash_id: int, seed: int = 0, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """The ``block_tokens`` token ids (in 1..63) standing for one Mooncake prompt block: a pure
    function of ``(hash_id, seed)``, so equal hash ids give equal tokens in every request and
    every process (``random.Random`` seeded by an int is the same on every run)."""
    return random.Random(hash_id * 1_000_003 + seed).choices(_TOKEN_IDS, k=block_tokens)


def mooncake_prompt(input_length: int, hash_ids: list[int], seed: int = 0,
                    cache: dict[int, list[int]] | None = None) -> list[int]:
    """A prompt of ``input_length`` synthetic token ids from a Mooncake row's ``hash_ids``: block
    ``i`` (tokens ``512 i .. 512 i + 511``) is ``block_token_ids(hash_ids[i])``, the last block cut
    to the prompt's length. Two rows whose leading ids agree share that prefix token for token.

    Raises:
        ValueError: ``len(hash_ids) != ceil(input_length / 512)`` (every row of the Mooncake
            traces satisfies it), or ``input_length < 0``.
    """
    if input_length < 0 or len(hash_ids) != -(-input_length // MOONCAKE_BLOCK_TOKENS):
        raise ValueError(f"input_length {input_length} needs {-(-input_length // MOONCAKE_BLOCK_TOKENS)} "
                         f"hash ids of {MOONCAKE_BLOCK_TOKENS} tokens, got {len(hash_ids)}")
    cache = {} if cache is None else cache
    out: list[int] = []
    for h in hash_ids:
        block = cache.get(h)
        if block is None:
            block = cache[h] = block_token_ids(h, seed)
        out.extend(block)
    del out[input_length:]
    return out


def load_mooncake(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    users: int = 1,
    seed: int = 0,
    trace_dir: str | os.PathLike | None = None,
) -> list[Request]:
    """Requests from a Mooncake FAST'25 JSONL trace (``timestamp`` ms since the trace's start,
    ``input_length``, ``output_length``, ``hash_ids``).

    Args:
        path: a ``.jsonl`` path, or a file name in the traces folder.
        limit: keep only the first ``limit`` rows (``None``: all).
        time_scale: multiply every arrival offset by this.
        users: the trace has no user id: each row's user is ``u1..u<users>``, drawn with ``seed``
            (the same draws as ``load_trace`` makes for a CSV without ``user_id``).
        seed: seed for user assignment; the prompt tokens depend on the hash ids only (and on
            nothing else, so that two runs, or Batch and vLLM, see the same prompts).
        trace_dir: the traces folder a bare file name is looked up in.

    Returns:
        Requests ``t0, t1, ...`` in file order: ``prompt = mooncake_prompt(input_length, hash_ids)``,
        ``max_tokens = output_length``, ``submitted_at`` = (timestamp - the first row's) / 1000 s,
        scaled.

    Raises:
        FileNotFoundError, IsADirectoryError: as ``resolve_trace``.
        ValueError: a malformed row, naming the file and the line: not JSON, a field missing or of
            the wrong type, a negative or non-finite timestamp, a length < 1 (no request could
            have it), hash ids that do not cover the prompt; ``time_scale`` or ``users`` out of range.
    """
    _check_scale_users(time_scale, users)
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    out: list[Request] = []
    first_ms: float | None = None
    with open(resolve_trace(path, trace_dir), encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}: line {line_no}"
            try:
                row = json.loads(line)
                ts_ms, plen, olen, ids = (row["timestamp"], row["input_length"], row["output_length"],
                                          row["hash_ids"])
                if not (all(type(v) is int for v in (plen, olen, *ids)) and isinstance(ts_ms, (int, float))
                        and not isinstance(ts_ms, bool)):
                    raise TypeError("timestamp must be a number; input_length, output_length and hash_ids ints")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{where}: not a Mooncake row ({type(e).__name__}: {e})") from None
            if not 0 <= ts_ms < math.inf or plen < 1 or olen < 1:
                raise ValueError(f"{where}: timestamp must be finite ms >= 0 and lengths >= 1 (a request has a "
                                 f"prompt and asks for a token), got timestamp={ts_ms!r}, input_length={plen}, "
                                 f"output_length={olen}")
            first_ms = ts_ms if first_ms is None else first_ms
            try:
                prompt = mooncake_prompt(plen, ids, cache=blocks)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            out.append(Request(user_id=f"u{rng.randint(1, users)}", prompt=prompt, max_tokens=olen,
                               request_id=f"t{len(out)}",
                               submitted_at=max(0.0, (ts_ms - first_ms) / 1e3 * time_scale)))
    return out
