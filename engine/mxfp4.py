"""MXFP4 (OCP microscaling FP4) decoding of the gpt-oss expert weights.

Storage (gpt-oss-spec §4): a logical weight [..., R, C] is kept as `blocks` uint8 [..., R, C/32, 16] and
`scales` uint8 [..., R, C/32]. Byte j of a block holds element 2j in its low nibble and 2j+1 in its high
nibble; a nibble is an E2M1 code and the block value is LUT[code] * 2^(scale - 127).
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per MXFP4 block, along the input (last) dimension
BYTES_PER_BLOCK = BLOCK // 2
SCALE_BIAS = 127

# E2M1 code -> value; bit 3 is the sign, so codes 8..15 mirror 0..7 (8 is -0).
FP4_E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)

# Above this many output elements the decode runs chunk by chunk over the leading dim so the float32
# intermediate stays bounded (a full 120b mlp1 would otherwise need 8.5 GB of scratch).
_CHUNK_ELEMENTS = 1 << 26


def block_range(col_start: int, col_stop: int) -> tuple[int, int, int]:
    """Blocks covering columns [col_start, col_stop): (first block, end block, offset of col_start in them)."""
    g0 = col_start // BLOCK
    g1 = -(-col_stop // BLOCK)
    return g0, g1, col_start - g0 * BLOCK


def _decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    # Interleave low/high nibbles so element 2j (low) precedes 2j+1 (high) once flattened.
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
    values = lut[codes]
    # ldexp by (s - 127) is exact: the LUT values have at most two significant bits.
    exponent = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return out.flatten(-2).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16] + scales uint8 [..., G] -> [..., G*32] in `dtype` (exact for bf16/f32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
            f"(expected blocks = scales + [{BYTES_PER_BLOCK}])")
    n_out = scales.numel() * BLOCK
    if blocks.dim() < 3 or n_out <= _CHUNK_ELEMENTS:
        return _decode(blocks, scales, dtype)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype, device=blocks.device)
    per_row = n_out // scales.shape[0]
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    for i in range(0, scales.shape[0], step):
        out[i:i + step] = _decode(blocks[i:i + step], scales[i:i + step], dtype)
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] float -> (blocks uint8 [..., C/32, 16], scales uint8 [..., C/32]).

    Round-to-nearest onto the E2M1 grid with the smallest power-of-two scale that keeps the block max
    representable. Used to write test checkpoints and for re-quantising; exact round trip for values
    already on the grid (dequantize_mxfp4(quantize_mxfp4(x)) == x when x came from dequantize_mxfp4).
    """
    if w.shape[-1] % BLOCK:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of {BLOCK}")
    x = w.to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(-1)
    # Smallest e with amax / 2^e <= 6 (the largest E2M1 magnitude); zero blocks get the smallest scale.
    e = torch.ceil(torch.log2(amax.clamp_min(2.0 ** -126) / 6.0))
    e = e.clamp(-SCALE_BIAS, 127)
    q = x / torch.exp2(e).unsqueeze(-1)
    grid = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    mag = (q.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    codes = (mag | ((q < 0).to(torch.int64) << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (e + SCALE_BIAS).to(torch.uint8)
