"""Model runner, KV cache and loader for the Llama family (Llama, Qwen2, Mistral)."""

from dsde_core.models.kv_cache import KVCache
from dsde_core.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel, ModelArgs
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, check_compatible, load_model
from dsde_core.models.packaged import PackagedModel
from dsde_core.models.runner import ModelRunner

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "KVCache",
    "LlamaModel",
    "LoadedModel",
    "ModelArgs",
    "ModelRunner",
    "PackagedModel",
    "SUPPORTED_MODEL_TYPES",
    "check_compatible",
    "load_model",
]
