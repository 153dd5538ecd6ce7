"""Batch's policies inside other serving engines. Nothing is imported here: each module needs its
engine installed (``batch.integrations.vllm``: vLLM, the ``vllm`` extra; ``docs/vllm-plugin.md``)."""
