"""Backends beyond the simulated GPU: ``model_backend``, a Hugging Face causal LM on Batch's paged
KV cache (the optional ``model`` extra: torch, transformers; imported only when asked for)."""
