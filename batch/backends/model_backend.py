"""A real model under the scheduler: a Hugging Face Llama-family ``*ForCausalLM`` on a paged KV cache.

The scheduler's KV ledger hands out concrete block ids (``kv_cache.BlockPool``); this module
owns the memory behind them. ``PagedKVCache`` holds one K and one V tensor per layer, shaped
``[num_blocks, block_tokens, kv_heads, head_dim]``. ``ModelBackend.execute_model`` runs one
iteration for the scheduler's ``BatchItem``s:

1. every item's new tokens are packed into one sequence ``[1, T]`` with their true positions
   (``num_computed_tokens + i``), so the model's own RoPE, MLP and norms run unchanged;
2. the model calls our attention function (registered with transformers'
   ``AttentionInterface`` as ``"batch_paged"``) once per layer with the packed queries, keys
   and values; for each item it reads the item's earlier KV from the cache through its block
   table, appends the new keys and values, and runs ``torch``'s scaled dot product attention
   with a causal mask offset by ``num_computed_tokens``;
3. after the whole forward pass succeeded, the new keys and values are written to the slots
   the block tables give, so a failed iteration leaves the cache as it was (the scheduler
   undoes the tick too);
4. greedy decoding: ``argmax`` of the logits at each sampled item's last token.

With ``Scheduler(prefix_caching=True)`` the block tables share the cached blocks of a common
prompt prefix and ``num_computed_tokens`` starts past them: step 2 reads their KV, written by the
request that computed them, and nothing here changes.

No model code is copied: the attention function is the only hook. Nothing is downloaded:
``tiny_llama`` builds a seeded random model from a ``LlamaConfig``, ``load_model`` reads a
local checkpoint directory (config + safetensors).

Source: PagedAttention (Kwon et al., SOSP 2023, vLLM) for block tables and slot mapping;
vLLM V1's flattened batch of prefill and decode tokens; transformers' attention interface
(``AttentionInterface.register``).

Requires the ``model`` extra: ``pip install -e '.[model]'`` (torch, transformers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from batch.core.backend_api import BatchItem
from scheduler import Scheduler

__all__ = ["ATTN_IMPLEMENTATION", "DeviceError", "PagedKVCache", "ModelBackend", "tiny_llama", "load_model",
           "resolve_device", "from_cli"]

#: The name our attention function is registered under in transformers' ``AttentionInterface``.
ATTN_IMPLEMENTATION = "batch_paged"


class DeviceError(ValueError):
    """A device that is not a torch device name, or that this machine lacks (``cuda`` without CUDA)."""


class PagedKVCache:
    """The KV cache as a pool of blocks: one K and one V tensor per layer.

    Args:
        num_layers: decoder layers of the model.
        num_blocks: blocks in the pool (the scheduler's ``kv_cap_blocks``).
        block_tokens: tokens per block (the scheduler's ``block_tokens``).
        kv_heads: key/value heads per layer (``num_key_value_heads``; fewer than query heads
            under grouped-query attention).
        head_dim: size of one head.
        dtype, device: of the cache tensors (the model's).

    Raises:
        ValueError: a size is not a positive int.

    ``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_tokens, kv_heads, head_dim]``. The
    token at position ``p`` of a request with block table ``bt`` lives at slot
    ``bt[p // block_tokens] * block_tokens + p % block_tokens`` of the flattened pool.
    Fresh caches are zero-filled; ``poison(blocks)`` fills blocks with NaN.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_tokens", block_tokens),
                        ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_tokens, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions ``start .. end - 1`` under ``block_table``: a 1-D long tensor (CPU).

        Raises:
            ValueError: the table is too short for ``end`` positions, or holds a block id
                outside ``0 .. num_blocks - 1``.
        """
        B = self.block_tokens
        n_blocks = -(-end // B)
        if n_blocks > len(block_table):
            raise ValueError(f"block table of {len(block_table)} blocks cannot hold {end} tokens")
        table = torch.tensor(block_table[:n_blocks], dtype=torch.long)
        if n_blocks and not (0 <= int(table.min()) and int(table.max()) < self.num_blocks):
            raise ValueError(f"block table {list(block_table)} has an id outside the pool of {self.num_blocks} blocks")
        p = torch.arange(start, end, dtype=torch.long)
        return table[p // B] * B + p % B

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (a 1-D long tensor) of ``layer``: two ``[len(slots), kv_heads, head_dim]``."""
        k = self.k[layer].view(-1, self.kv_heads, self.head_dim)
        v = self.v[layer].view(-1, self.kv_heads, self.head_dim)
        return k.index_select(0, slots), v.index_select(0, slots)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[len(slots), kv_heads, head_dim]``) at ``slots`` of ``layer``."""
        self.k[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v)

    def poison(self, blocks: Sequence[int]) -> None:
        """Fill ``blocks`` with NaN in every layer, so a later read of them shows in the output."""
        if not blocks:
            return
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.k[0].device)
        for t in self.k + self.v:
            t.index_fill_(0, idx, float("nan"))


@dataclass
class _Segment:
    """One item's share of the packed sequence, with its cache slots on the model's device."""

    start: int  # index of the item's first token in the packed sequence
    end: int
    past_slots: torch.Tensor | None  # slots of positions 0 .. num_computed_tokens - 1 (None when 0)
    mask: torch.Tensor | None  # [n, num_computed + n] bool, True = may attend (None: no mask needed)


@dataclass
class _PagedBatch:
    """Passed through the model's ``**kwargs`` to ``paged_attention``, one per ``execute_model`` call."""

    cache: PagedKVCache
    segments: list[_Segment]
    new_slots: torch.Tensor  # [T]: where each packed token's K/V goes
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> new K, V


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    paged_batch: _PagedBatch | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls in every layer (``attn_implementation="batch_paged"``).

    Args:
        module: the layer's attention module (``layer_idx``, ``num_key_value_groups``).
        query: ``[1, q_heads, T, head_dim]``, the packed new tokens of every item, RoPE applied.
        key, value: ``[1, kv_heads, T, head_dim]``, the same tokens' new keys and values.
        attention_mask: ignored (no mask function is registered; each item builds its own).
        scaling: softmax scale (``head_dim ** -0.5`` for Llama).
        paged_batch: the iteration's items and cache, passed by ``ModelBackend.execute_model``.

    Returns:
        ``([1, T, q_heads, head_dim], None)``, the layout transformers' own functions return.

    Raises:
        RuntimeError: called without ``paged_batch`` (the model was run outside ``ModelBackend``).
        NotImplementedError: the layer asks for logit soft-capping, attention sinks or a
            sliding window shorter than the cache.
    """
    if paged_batch is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside ModelBackend.execute_model")
    window = kwargs.get("sliding_window")
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if window is not None and window < paged_batch.cache.num_blocks * paged_batch.cache.block_tokens:
        unsupported.append("sliding_window")
    if unsupported:  # attention variants this function does not compute: refuse rather than differ silently
        raise NotImplementedError(f"paged attention does not support {unsupported}")
    layer = module.layer_idx
    cache = paged_batch.cache
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    new_k = key[0].transpose(0, 1)  # [T, kv_heads, D]
    new_v = value[0].transpose(0, 1)
    paged_batch.pending[layer] = (new_k, new_v)
    outs = []
    for seg in paged_batch.segments:
        q = query[:, :, seg.start:seg.end]
        k = key[:, :, seg.start:seg.end]
        v = value[:, :, seg.start:seg.end]
        if seg.past_slots is not None:
            pk, pv = cache.gather(layer, seg.past_slots)  # [past, kv_heads, D]
            k = torch.cat([pk.transpose(0, 1).unsqueeze(0), k], dim=2)
            v = torch.cat([pv.transpose(0, 1).unsqueeze(0), v], dim=2)
        causal = seg.mask is None and seg.end - seg.start > 1  # a first chunk: plain causal
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, is_causal=causal, scale=scaling,
                                                   enable_gqa=gqa))
    out = torch.cat(outs, dim=2)  # [1, q_heads, T, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class ModelBackend:
    """Runs a Hugging Face causal LM for the scheduler, one iteration per ``execute_model`` call.

    Args:
        model: a Llama-family ``*ForCausalLM`` whose attention goes through transformers'
            ``AttentionInterface`` (Llama, Mistral, Qwen2, ...). It is switched to
            ``attn_implementation="batch_paged"`` and put in eval mode.
        num_blocks: KV blocks in the cache (give the scheduler the same ``kv_cap_blocks``).
        block_tokens: tokens per block (the scheduler's ``block_tokens``, 16).
        device, dtype: where and in what the model and the cache live (default: the model's).
        poison_freed_blocks: when ``attach``-ed to a scheduler, fill blocks with NaN as the
            scheduler frees them, so any stale read turns the output into NaN (a test aid).
        record_logits: keep ``logits[request_id]``, the float64 logits row of every sampled
            token, in order (a test aid; grows without bound).

    Raises:
        ValueError: a size is not a positive int, the model has a sliding window shorter than
            the cache, or its attention cannot be swapped.

    Greedy decoding: the token is the ``argmax`` of the logits (lowest id on a tie). When the
    model has several EOS ids, any of them is returned as ``eos_token_id`` (the first), the
    one id the scheduler checks.
    """

    def __init__(self, model: PreTrainedModel, *, num_blocks: int = 256, block_tokens: int = 16,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 poison_freed_blocks: bool = False, record_logits: bool = False) -> None:
        cfg = model.config
        if not model._can_set_attn_implementation():
            raise ValueError(f"{type(model).__name__} does not route attention through AttentionInterface")
        window = getattr(cfg, "sliding_window", None)
        if window is not None and getattr(cfg, "use_sliding_window", True) and window < num_blocks * block_tokens:
            raise ValueError(f"sliding-window attention ({window} tokens) is not supported")
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = PagedKVCache(num_layers=cfg.num_hidden_layers, num_blocks=num_blocks, block_tokens=block_tokens,
                                  kv_heads=kv_heads, head_dim=head_dim, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.vocab_size: int = cfg.vocab_size
        eos = cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (int(eos),))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.poison_freed_blocks = poison_freed_blocks
        self.record_logits = record_logits
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.iterations = 0
        self.tokens_processed = 0

    def scheduler_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that make a ``Scheduler`` match this backend.

        ``backend`` (this object), ``kv_cap_blocks``, ``block_tokens``, ``eos_token_id`` (-1,
        which never matches, for a model without one: ``None`` would mean the stub's EOS, token
        0) and ``vocab_size``. Pass them with ``Scheduler(**backend.scheduler_kwargs(), ...)`` and then
        call ``attach`` on the scheduler.
        """
        return {"backend": self, "kv_cap_blocks": self.num_blocks, "block_tokens": self.block_tokens,
                "eos_token_id": -1 if self.eos_token_id is None else self.eos_token_id, "vocab_size": self.vocab_size}

    def make_scheduler(self, **kwargs: Any) -> Scheduler:
        """A ``Scheduler`` wired to this backend (``scheduler_kwargs``, then ``attach``).

        Args:
            **kwargs: further ``Scheduler`` knobs (``clock``, ``token_budget_tokens``, ...). A
                ``backend`` argument is ignored (``simulate.run_workload`` passes its stub's);
                ``kv_cap_blocks`` and ``block_tokens`` must match the cache if given.
        """
        kwargs.pop("backend", None)
        kw = self.scheduler_kwargs() | kwargs
        return self.attach(Scheduler(**kw))

    def describe(self) -> str:
        """One line: model class, layers, parameters, dtype, device, cache size."""
        cfg = self.model.config
        n_params = sum(p.numel() for p in self.model.parameters())
        return (f"{type(self.model).__name__} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                f"vocabulary {self.vocab_size}, {n_params / 1e6:.2f} M parameters, EOS {self.eos_token_id}), "
                f"{str(self.dtype).removeprefix('torch.')} on {self.device}; paged KV cache {self.num_blocks} blocks x "
                f"{self.block_tokens} tokens = {self.cache.nbytes / 2**20:.1f} MiB")

    def attach(self, scheduler: Any) -> Any:
        """Check that ``scheduler`` matches this cache; with ``poison_freed_blocks``, poison the
        blocks its pool frees from now on (with prefix caching, only those nobody holds and the
        prefix cache does not keep: a cached block's KV is read by every later hit on it).
        Returns the scheduler.

        Raises:
            ValueError: the scheduler's ``kv_cap_blocks`` or ``block_tokens`` differ from the cache's.
        """
        if (scheduler.config.kv_cap_blocks, scheduler.config.block_tokens) != (self.num_blocks, self.block_tokens):
            raise ValueError(f"scheduler has {scheduler.config.kv_cap_blocks} blocks of {scheduler.config.block_tokens} tokens, "
                             f"the cache {self.num_blocks} of {self.block_tokens}")
        if self.poison_freed_blocks:
            pool = scheduler.pool
            if getattr(scheduler.config, "prefix_caching", False):
                # a freed block another table still holds, or one the prefix cache keeps (its KV is
                # read again on a hit), is not garbage: poison only those back on the free list
                scheduler.pool.on_free = lambda blocks: self.cache.poison(
                    [b for b in blocks if pool.refs[b] == 0 and b not in pool.key_of])
            else:
                scheduler.pool.on_free = self.cache.poison
        return scheduler

    @torch.inference_mode()
    def execute_model(self, items: list[BatchItem]) -> list[int]:
        """Run one iteration: write every item's new KV, return one greedy token per item.

        Args:
            items: from ``Scheduler.tick()``; see ``backend_api.BatchItem``.

        Returns:
            One token id per item, in order; ``-1`` for an item with ``sample=False`` (its
            token is discarded by the scheduler, so no logits are computed for it).

        Raises:
            ValueError: an item has no tokens, a token id outside the vocabulary, or a block
                table that does not cover its positions. The cache is unchanged on any error.
        """
        if not items:
            return []
        ids: list[int] = []
        pos: list[int] = []
        new_slots: list[torch.Tensor] = []
        segments: list[_Segment] = []
        keep: list[int] = []
        cache = self.cache
        dev = self.device
        for it in items:
            n = len(it.token_ids)
            c = it.num_computed_tokens
            if n == 0:
                raise ValueError(f"{it.request.request_id}: no tokens to process")
            bad = [t for t in it.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{it.request.request_id}: token ids {bad[:4]} outside the vocabulary of {self.vocab_size}")
            start = len(ids)
            ids.extend(it.token_ids)
            pos.extend(range(c, c + n))
            slots = cache.slots(it.block_table, 0, c + n)
            new_slots.append(slots[c:])
            past = slots[:c].to(dev) if c else None
            mask = None
            if c and n > 1:  # a later chunk: query i (position c + i) sees keys 0 .. c + i
                mask = (torch.arange(c + n, device=dev)[None, :] <= torch.arange(c, c + n, device=dev)[:, None])
            segments.append(_Segment(start, start + n, past, mask))
            if it.sample:
                keep.append(start + n - 1)
        batch = _PagedBatch(cache=cache, segments=segments,
                            new_slots=torch.cat(new_slots).to(dev))
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        position_ids = torch.tensor([pos], dtype=torch.long, device=dev)
        keep_idx = torch.tensor(keep or [len(ids) - 1], dtype=torch.long, device=dev)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep_idx,
                         paged_batch=batch)
        for layer, (k, v) in batch.pending.items():  # commit only after the whole pass succeeded
            cache.write(layer, batch.new_slots, k, v)
        logits = out.logits[0]  # [len(keep_idx), vocab]
        greedy = logits.argmax(dim=-1).tolist() if keep else []
        tokens: list[int] = []
        j = 0
        for it in items:
            if not it.sample:
                tokens.append(-1)
                continue
            t = int(greedy[j])
            if self.record_logits:
                self.logits.setdefault(it.request.request_id, []).append(logits[j].to(torch.float64).cpu())
            j += 1
            tokens.append(self.eos_token_id if t in self.eos_token_ids else t)
        self.iterations += 1
        self.tokens_processed += len(ids)
        return tokens


def tiny_llama(*, seed: int = 0, vocab_size: int = 256, hidden_size: int = 64, num_hidden_layers: int = 2,
               num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
               max_position_embeddings: int = 8192, eos_token_id: int = 2, initializer_range: float = 0.02,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """A small Llama with seeded random weights, built offline (no download).

    Args:
        seed: ``torch.manual_seed`` for the weights; the same seed gives the same model.
        vocab_size, hidden_size, ...: ``LlamaConfig`` fields (defaults: 2 layers, hidden 64,
            4 query heads over 2 KV heads (grouped-query attention), vocabulary 256).
        initializer_range: std of the random weights.
        dtype, device: of the returned model.

    Returns:
        A ``LlamaForCausalLM`` in eval mode with ``attn_implementation="sdpa"`` (the plain
        transformers path, the reference in tests; ``ModelBackend`` switches the model it is given
        to the paged one).
    """
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                      intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                      eos_token_id=eos_token_id, bos_token_id=1, pad_token_id=None,
                      initializer_range=initializer_range, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype).eval()


def load_model(path: str | Path, *, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> PreTrainedModel:
    """A causal LM from a local checkpoint directory (``config.json`` + safetensors); never downloads.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a ``config.json`` (missing, a file, or
            a directory without one); checked before anything is loaded.
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a checkpoint directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype or "auto",
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def resolve_device(device: str | None) -> torch.device:
    """The torch device a model will run on, checked to exist on this machine before any model is built.

    Args:
        device: a torch device name (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ...); ``None``
            picks ``cuda`` when present, else ``cpu``.

    Returns:
        The parsed ``torch.device``.

    Raises:
        DeviceError: ``device`` is not a torch device name; names ``cuda`` (or ``cuda:N``) while
            CUDA is unavailable (or has no device ``N``); names another accelerator type whose
            torch module says it is unavailable (``mps``, ``xpu``, ...); or is ``meta`` (holds
            no data, so no model can run on it).
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise DeviceError(f"device {device!r} is not a torch device name (cpu, cuda, cuda:N, mps, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"device {device!r}: MPS is not available on this machine")
    elif dev.type == "meta":
        raise DeviceError(f"device {device!r} holds no data: a model cannot run on it")
    elif dev.type != "cpu":
        module = getattr(torch, dev.type, None)
        is_available = getattr(module, "is_available", None)
        if callable(is_available) and not is_available():
            raise DeviceError(f"device {device!r}: {dev.type} is not available on this machine")
    return dev


def from_cli(*, path: str | None = None, device: str | None = None, dtype: str = "float32",
             num_blocks: int = 256, block_tokens: int = 16) -> ModelBackend:
    """The backend ``python -m batch --backend model`` runs: a local checkpoint, or the tiny seeded Llama.

    Every argument is checked before a model is built or loaded.

    Args:
        path: a checkpoint directory; ``None`` builds ``tiny_llama(seed=0)``.
        device: a torch device name; ``None`` picks ``cuda`` when present, else ``cpu``.
        dtype: ``float32``, ``float64``, ``bfloat16`` or ``float16``.
        num_blocks, block_tokens: the paged KV cache's size.

    Raises:
        ValueError: an unknown dtype; a model ``ModelBackend`` cannot run (see there).
        DeviceError: (a ``ValueError``) ``device`` is not a torch device name or this machine
            lacks it (see ``resolve_device``).
        FileNotFoundError: ``path`` is not a checkpoint directory.
    """
    dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    dev = resolve_device(device)
    if path is None and dev.type == "cpu":
        # The tiny model's ops are microseconds long: intra-op threads only add spin-waits, which
        # stall an iteration for ~0.4 s when another process holds the cores (measured on 2 cores).
        torch.set_num_threads(1)
    model = load_model(path, dtype=dtypes[dtype], device=dev) if path else tiny_llama(dtype=dtypes[dtype], device=dev)
    return ModelBackend(model, num_blocks=num_blocks, block_tokens=block_tokens)
