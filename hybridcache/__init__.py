"""hybridcache: a prefix cache and inference engine for hybrid language models.

    from hybridcache import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

Names are imported lazily, so `import hybridcache.cache` (pure Python) does not pull in torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "hybridcache.llm",
    "AsyncLLM": "hybridcache.async_llm",
    "LLMEngine": "hybridcache.engine.engine",
    "EngineConfig": "hybridcache.config",
    "SamplingParams": "hybridcache.sampling",
    "RequestOutputKind": "hybridcache.sampling",
    "RequestOutput": "hybridcache.outputs",
    "CompletionOutput": "hybridcache.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridcache' has no attribute {name!r}")
