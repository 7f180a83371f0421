"""Kernel registries, one per op family: a family's implementations are classes registered by name, and the
runner picks one by name (`get_backend(device, attention=...)`, the engine's `attention_backend` option).

    ATTENTION    write_kv + attention (`hybridcache.kernels.attention.base.AttentionBackend`): "reference",
                 "triton", registered in `hybridcache/kernels/attention/` (one module per backend)
    GEMM         the FP8 linear (`hybridcache.kernels.gemm.base.GemmBackend`): "reference" (dequantise, any
                 device), "triton" (CUDA: the block-scaled Triton GEMM, `torch._scaled_mm` per channel),
                 registered in `hybridcache/kernels/gemm/`; an `Fp8Linear` names one in its `gemm` (None: the
                 device's default, `kernels.backend.gemm_backend`)
    ENCODER_ATTENTION  bidirectional attention within each segment of a packed batch (the vision tower's,
                 `hybridcache.kernels.encoder_attention.base.EncoderAttention`): "reference" (SDPA per segment,
                 any device), "flash_varlen" (CUDA), registered in `hybridcache/kernels/encoder_attention/`; the
                 tower gets one from `kernels.backend.encoder_attention` (None: the device's default)

A new implementation is one class in its family's folder with `@ATTENTION.register("name")`, in a module that
the family's `__init__.py` imports (so importing the family registers it). A module that needs CUDA-only
packages imports them inside its methods, so registering never imports Triton. A new family (a `gemm` family of
FP8 matrix products, say) is one more `OpRegistry` here, its protocol and backends in its own folder, and one
more `get_backend` argument. The families not split out yet (gated delta, conv, MoE, norms, rotary) are chosen
per device with the backend class (`ReferenceBackend` / `CudaBackend` in `hybridcache.kernels.backend`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class OpRegistry:
    """Named implementations of one op family (classes, constructed with no arguments). Each class may set
    `devices` (the `torch.device` types it runs on, e.g. ("cuda",); absent: any device)."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register the class under `name` (a name registered twice is a ValueError)."""

        def add(cls: type) -> type:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.family} backend {name!r} is already registered ({self._classes[name]})")
            self._classes[name] = cls
            return cls

        return add

    def unregister(self, name: str) -> None:
        """Remove `name` (tests that register a backend of their own clean up with it)."""
        self._classes.pop(name, None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))

    def create(self, name: str, device_type: str) -> Any:
        """A new instance of the class registered as `name`; ValueError naming the registered ones when there is
        none, or naming the devices it runs on when `device_type` is not one of them."""
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.family} backend {name!r}; registered: {', '.join(self.names)}")
        devices = getattr(cls, "devices", None)
        if devices is not None and device_type not in devices:
            raise ValueError(f"{self.family} backend {name!r} runs on {', '.join(devices)} devices, not {device_type}")
        return cls()


ATTENTION = OpRegistry("attention")
GEMM = OpRegistry("gemm")
ENCODER_ATTENTION = OpRegistry("encoder attention")
