"""GEMM kernels of quantized linear layers (FP8 e4m3 weights).

`reference.py`: the formats' arithmetic in torch (quantize, dequantize, the dequantising linear: the ground truth
and the CPU path). `triton_block_fp8.py`: the block-scaled FP8 GEMM (DeepSeek-V3 recipe), `triton_fp8_moe.py`: the
FP8 grouped expert GEMM with the same scales, `scaled_mm.py`: per-channel FP8 through `torch._scaled_mm`.
`dispatch.py`: `fp8_linear`, the one place that picks the kernel for a weight's format and device."""
