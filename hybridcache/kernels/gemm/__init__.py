"""GEMM kernels: the dense bf16 projections (`dense.py`: cuBLAS or the skinny Triton GEMM of `triton_skinny.py`,
measured per shape, through `kernels.backend.dense_linear`) and those of quantized linear layers (FP8 e4m3
weights), the `GEMM` op family of `kernels.registry`.

`reference.py`: the formats' arithmetic in torch (quantize, dequantize, the dequantising linear: the ground truth
and the CPU path). `triton_block_fp8.py`: the block-scaled FP8 GEMM (DeepSeek-V3 recipe), `triton_fp8_moe.py`: the
FP8 grouped expert GEMM with the same scales, `scaled_mm.py`: per-channel FP8 through `torch._scaled_mm`.
Backends (registered on import): `reference_backend.py` ("reference"), `triton_backend.py` ("triton", CUDA)."""

from hybridcache.kernels.gemm import reference_backend, triton_backend  # noqa: F401 (register the backends)
