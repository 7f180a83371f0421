"""The vision tower of Qwen3.5 / Qwen3.5-MoE (`model.visual.*`): pixels of image patches in, one
language-model input embedding per merged group of patches out. A torch reference, checked against
transformers' `Qwen3_5VisionModel`.

Module tree (names equal the checkpoint's after `model.visual.`)::

    patch_embed.proj        Conv3d [hidden, C, T, P, P], stride = kernel: a linear map of each patch row
    pos_embed               [grid_side^2, hidden] learned positions, resampled bilinearly to each image's grid
    blocks.{i}.norm1/norm2  LayerNorm
    blocks.{i}.attn.qkv     [3 hidden, hidden] (+ bias); attn.proj [hidden, hidden] (+ bias)
    blocks.{i}.mlp.linear_fc1 / linear_fc2   GELU (tanh approximation) MLP
    merger.norm             LayerNorm over each patch; merger.linear_fc1 [4h, 4h] / linear_fc2 [out, 4h] over
                            the concatenation of a 2 x 2 group of patches, exact GELU between

Input layout (what transformers' image processor for these models emits): `pixel_values` [N, C*T*P*P], the
patches of image after image; an image of grid (t, h, w) patches owns t*h*w rows, ordered frame by frame and,
within a frame, merge block by merge block (block row, block column, row in block, column in block). So every
`spatial_merge_size**2` consecutive rows are one merged token, in raster order of the merged grid.

Attention is bidirectional within one frame of one image and never across images: an encoder attention backend
(`hybridcache.kernels.encoder_attention`) over the packed frames of every image of the call. "reference" (torch
SDPA per frame) until `use_attention` picks another; the loader calls `use_attention(None)`: the device's default,
"flash_varlen" on CUDA in fp16 / bf16 (one varlen FlashAttention call per block for all frames).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.embedding import embedding
from hybridcache.models.vision_config import VisionConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches, as transformers' image_grid_thw
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, k, v [N, H, D] -> [N, H, D]


class VisionAttention(nn.Module):
    """Multi-head self-attention over the patches of one frame, with 2-D rotary positions."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
        """x [N, hidden]; rope: cos, sin [N, head_dim]; attend(q, k, v): the call's encoder attention over frames."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, -1)
        q, k = _rotate_qk(qkv[:, :2], *rope)
        return self.proj(attend(q, k, qkv[:, 2]).reshape(n, -1))


def _rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head dim of q and k together, in fp32, rounded back to qk's dtype once.
    qk [N, 2, H, D] (q, k); cos, sin [N, D] -> [2, N, H, D], contiguous (q and k each contiguous)."""
    xf = qk.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = torch.empty((2, *qk.shape[:1], *qk.shape[2:]), dtype=qk.dtype, device=qk.device)
    out.copy_((xf * cos[:, None, None] + rotated * sin[:, None, None]).transpose(0, 1))
    return out


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, attend)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, C*T*P*P] -> [N, hidden]: the convolution's single output per patch, as a matrix product."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.merge_unit
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size, bias=True)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N / merge_unit, out_hidden]."""
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """`tower(pixel_values, grids)` -> one embedding tensor per image, [t*h*w / merge_unit, out_hidden_size] each
    (see the module docstring for the input layout). Runs under `torch.inference_mode`. `attention`: its encoder
    attention backend ("reference" until `use_attention` names another)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.attention: kernel_backend.EncoderAttention = kernel_backend.encoder_attention(
            "reference", "cpu", torch.float32, config.head_dim)
        self.attention_name = "reference"
        self.eval()
        self.requires_grad_(False)

    def use_attention(self, name: str | None) -> None:
        """Attend with the encoder attention backend registered as `name` (None: the default for the weights'
        device and dtype); ValueError (nothing changed) when it does not run on the weights' device or cannot run
        their dtype and the head dim (`kernels.backend.encoder_attention`)."""
        weight, head_dim = self.pos_embed.weight, self.config.head_dim
        device_type, dtype = weight.device.type, weight.dtype
        name = name or kernel_backend.default_encoder_attention(device_type, dtype, head_dim)
        self.attention = kernel_backend.encoder_attention(name, device_type, dtype, head_dim)
        self.attention_name = name

    def check_grid(self, grid: Grid) -> None:
        """ValueError unless `grid` is (t, h, w) positive with h and w multiples of the spatial merge size."""
        t, h, w = grid
        merge = self.config.spatial_merge_size
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise ValueError(f"image grid {grid} (t, h, w patches) must be positive with h and w multiples of {merge}")

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> list[torch.Tensor]:
        config = self.config
        for grid in grids:
            self.check_grid(grid)
        num_patches = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (num_patches, config.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
                             f"{(num_patches, config.patch_dim)} for grids {list(grids)}")
        with torch.inference_mode():
            device = self.pos_embed.weight.device
            x = self.patch_embed(pixel_values.to(device))
            x = x + torch.cat([self._positions(grid) for grid in grids]).to(x.dtype)
            rope = self._rotary(grids, device)
            metadata = self.attention.prepare([h * w for t, h, w in grids for _ in range(t)], device)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return self.attention.attention(q, k, v, metadata)

            for block in self.blocks:
                x = block(x, rope, attend)
            merged = self.merger(x)
        return list(merged.split([t * h * w // config.merge_unit for t, h, w in grids]))

    def _block_order(self, table: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h*w, ...] in merge-block order (see the module docstring)."""
        m = self.config.spatial_merge_size
        rest = table.shape[2:]
        return table.reshape(h // m, m, w // m, m, *rest).transpose(1, 2).reshape(h * w, *rest)

    def _positions(self, grid: Grid) -> torch.Tensor:
        """The learned position table resampled to grid (h, w) (bilinear, corners aligned): [t*h*w, hidden]."""
        t, h, w = grid
        side = self.config.grid_side
        table = self.pos_embed.weight.float().reshape(side, side, -1).permute(2, 0, 1)[None]
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        return self._block_order(resized, h, w).repeat(t, 1)

    def _rotary(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] fp32: head_dim/4 frequencies of the patch's row, then of its column, twice."""
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        coords = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            raster = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
            coords.append(self._block_order(raster, h, w).repeat(t, 1))
        coords = torch.cat(coords).float()  # [N, 2]
        freqs = (coords[:, :, None] * inv_freq).reshape(coords.shape[0], -1)  # [N, head_dim / 2]: rows | columns
        angles = torch.cat((freqs, freqs), dim=-1).to(device)
        return angles.cos(), angles.sin()
