"""Adapters that make frameworks dispatch attention through a runner's binding.

``attn_dispatch.integrations.transformers`` (Hugging Face transformers models) and
``attn_dispatch.integrations.sglang`` (SGLang forward-mode names). Each is imported on demand;
importing this package imports no framework.
"""
