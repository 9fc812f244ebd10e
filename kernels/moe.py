"""gpt-oss MoE on the GPU: Triton routing, expert GEMMs with bias, fused clamped SwiGLU, weighted combine.

Math (spec §2.3): logits = h W_g^T + b_g; top-4; softmax over those 4 in bf16; per expert
u = W1 h + b1 with rows interleaved (even = gate, odd = up); act = min(g,7) * sigmoid(1.702 min(g,7))
* (clamp(u,-7,7) + 1); y = W2 act + b2; out = sum_j w_j y_j.

Two expert paths, chosen by the number of (token, expert) pairs:
- "gemv" (decode, few pairs; kernels/moe_gemv.py): one program per (pair, N tile) streams that expert's
  weight rows once and never sorts tokens; bias, SwiGLU and routing weight fused, the k experts summed in
  a fixed order (bit-exact replay). Memory-bound: its floor is the bytes of the active experts.
- "grouped" (prefill / big batches): pairs sorted by expert into BLOCK_M-padded groups (graph-safe
  Triton counting sorts, kernels/moe_sort.py, no host sync), then a Triton grouped GEMM (tl.dot; fp8 with 1x128 x 128x128 block scales
  or bf16) with bias (+ SwiGLU, or + routing weight) in the epilogue.
- "torch" (bf16 weights only): torch._grouped_mm over expert-sorted rows, for comparison.
  torch._scaled_grouped_mm takes row-wise scales only, not our 128x128 blocks, so it is not an FP8 path.
The grouped path's launch config (tile, warps, stages and knobs: program order for L2 reuse, unmasked
loads, TMA weight tiles) comes from the GPU's tuned table when there is one (kernels/moe_configs.py,
written by `python -m kvrelay.bench.tune_moe`), else from a heuristic made for hidden = intermediate =
2880 (23 K blocks of 128 after padding to 2944).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import moe_configs, moe_fused, moe_ws, router
from .fp8_gemm import BLOCK, quantize_act_1x128
from .moe_configs import GemmConfig, GroupedConfig
from .moe_gemv import GEMV_MAX_PAIRS, MoePending, moe_gemv, pair_dtype
from .moe_mxfp4 import MAX_SCALE, moe_mxfp4
# the pair sort lives in kernels/moe_sort.py; re-exported here, where its callers (and tests) look for it
from .moe_sort import SORT_KERNEL_MAX_PAIRS, quantize_sorted, sort_by_expert, tile_order  # noqa: F401
from .moe_gemv import swiglu as _swiglu  # the clamped SwiGLU, fused into both paths' GEMM1
from .pdl import enter, pdl_kwargs
# the top-k + softmax lives with the one-launch router that shares it (kernels/router.py); re-exported here
from .router import topk_softmax  # noqa: F401

try:  # host-side TMA descriptors: triton >= 3.4 (the tma knob of the grouped GEMM)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


# --------------------------------------------------------------------------------------------------
# routing
# --------------------------------------------------------------------------------------------------
@triton.jit
def _route_kernel(logits, bias, w_out, id_out, T, E, s_lt, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                  E_P2: tl.constexpr, BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_P2)
    ok = (t < T)[:, None] & (e < E)[None, :]
    v = tl.load(logits + t.to(tl.int64)[:, None] * s_lt + e[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(bias + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
    # The served router output is bf16 (the reference's linear rounds once): top-k on those values.
    v = v.to(tl.bfloat16).to(tl.float32)
    v = tl.where(ok, v, float("-inf"))
    w, ids = topk_softmax(v, e, K, E_P2)
    kk = tl.arange(0, K)
    o = t.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(w_out + o, w.to(w_out.dtype.element_ty), mask=(t < T)[:, None])
    tl.store(id_out + o, ids.to(tl.int64), mask=(t < T)[:, None])


def route_topk(router_logits: torch.Tensor, k: int, bias: torch.Tensor | None = None):
    """Drop-in for kernels.reference.route_topk (+ optional bias added here): (weights bf16 [T, k],
    expert ids int64 [T, k]) in descending logit order."""
    t, e = router_logits.shape
    w = torch.empty(t, k, dtype=torch.bfloat16, device=router_logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=router_logits.device)
    if t:
        block_t = 16
        _route_kernel[(triton.cdiv(t, block_t),)](
            router_logits, bias if bias is not None else router_logits, w, ids, t, e, router_logits.stride(0),
            HAS_BIAS=bias is not None, K=k, E_P2=triton.next_power_of_2(e), BLOCK_T=block_t, num_warps=4,
            **pdl_kwargs(router_logits.device))
    return w, ids


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------
@dataclass
class MoEWeights:
    """Stacked expert weights. fp8: w* e4m3 with K padded to a multiple of 128 and block scales
    [E, ceil(N/128), Kp/128]; bf16: scales None; mx (MXFP4 as shipped, kernels/moe_mxfp4.py): w* the bytes
    [E, N, K/2] and s* the E8M0 scale bytes [E, N, K/32]. Biases bf16."""

    w1: torch.Tensor   # [E, 2I, Hp]
    b1: torch.Tensor   # [E, 2I]
    w2: torch.Tensor   # [E, H, Ip]
    b2: torch.Tensor   # [E, H]
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    hidden: int = 0
    inter: int = 0
    # the grouped GEMMs' TMA descriptors of w1/w2, built once per (weight, tile) (_weight_desc)
    descs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    mx: bool = False

    @property
    def fp8(self) -> bool:
        return self.s1 is not None and not self.mx

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @staticmethod
    def _pad(w: torch.Tensor, kp: int) -> torch.Tensor:
        if w.shape[-1] == kp:
            return w.contiguous()
        out = torch.zeros(*w.shape[:-1], kp, dtype=w.dtype, device=w.device)
        out[..., : w.shape[-1]] = w
        return out

    @classmethod
    def from_bf16(cls, w1, b1, w2, b2) -> "MoEWeights":
        return cls(w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous(), None, None,
                   w1.shape[2], w2.shape[2])

    @classmethod
    def from_mxfp4(cls, w1, s1, b1, w2, s2, b2) -> "MoEWeights":
        """From the checkpoint's blocks [E, N, K/32, 16] and scales [E, N, K/32] (uint8), kept as they are: the
        blocks are only viewed as [E, N, K/2] (no copy when contiguous)."""
        for name, blocks, scales in (("mlp1", w1, s1), ("mlp2", w2, s2)):
            if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
                raise ValueError(f"{name}: MXFP4 blocks {list(blocks.shape)} {blocks.dtype} do not match scales "
                                 f"{list(scales.shape)} {scales.dtype}")
            if scales.numel() and int(scales.max()) > MAX_SCALE:
                raise ValueError(f"{name}: an MXFP4 scale byte is {int(scales.max())}, above {MAX_SCALE} (weights "
                                 f"beyond 2^{MAX_SCALE - 127}): not a gpt-oss checkpoint this kernel serves")
        flat = lambda blk: blk.contiguous().view(*blk.shape[:-2], -1)  # noqa: E731
        return cls(flat(w1), b1.contiguous(), flat(w2), b2.contiguous(), s1.contiguous(), s2.contiguous(),
                   w1.shape[-2] * 32, w2.shape[-2] * 32, mx=True)

    @classmethod
    def from_fp8(cls, w1, s1, b1, w2, s2, b2) -> "MoEWeights":
        h, i = w1.shape[2], w2.shape[2]
        hp, ip = triton.cdiv(h, BLOCK) * BLOCK, triton.cdiv(i, BLOCK) * BLOCK
        return cls(cls._pad(w1, hp), b1.contiguous(), cls._pad(w2, ip), b2.contiguous(),
                   s1.float().contiguous(), s2.float().contiguous(), h, i)


# --------------------------------------------------------------------------------------------------
# prefill path: expert-sorted grouped GEMM
# --------------------------------------------------------------------------------------------------
# n_pairs, num_m and E are only compared against: not specializing them keeps one compiled kernel per config
# whatever the batch (a pair or block count divisible by 16 would otherwise compile a second variant).
@triton.jit(do_not_specialize=["num_m", "n_pairs", "E"])
def _grouped_kernel(a, a_desc, sa, w, w_desc, sw, b, rw, out, sorted_ids, block_expert, num_m, n_pairs, E, N, KDIM, ROW_DIV,
                    s_am, s_sam, s_sak, s_we, s_wn, s_swe, s_swn, s_be, s_om,
                    FP8: tl.constexpr, SWIGLU: tl.constexpr, MUL_ROUTE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, MASKED: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                    ALPHA: tl.constexpr, LIMIT: tl.constexpr, A_SORTED: tl.constexpr = False,
                    OUT_SORTED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    # kernels/pdl.py: every program waits (even those returning early below) before its first load, all of
    # which (block_expert, sorted_ids, activations; the weights' expert comes from block_expert) follow
    enter(USE_PDL)
    # One program per (M block, N tile) on a 1-D grid, in moe_sort.tile_order's order (L2 reuse of weight tiles)
    pid_m, pid_n = tile_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    e32 = tl.load(block_expert + pid_m)
    if e32 >= E:  # an empty block past the last expert's (sort_by_expert's max_blocks bound)
        return
    e = e32.to(tl.int64)
    pairs = tl.load(sorted_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < n_pairs
    # A_SORTED: the A rows are the sort's slots (moe_sort.quantize_sorted, or GEMM1's OUT_SORTED output), read
    # as one TMA tile a K step; else each slot's row is gathered from its pair's token (or pair) row.
    slots = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if MASKED:
        wn = offs_n
    else:
        # Padding rows read row 0 and the N tail re-reads row N-1: in-bounds addresses, so the loads
        # need no masks; those rows and columns are never stored.
        wn = tl.minimum(offs_n, N - 1)
    if A_SORTED:
        rows = slots
    elif MASKED:
        rows = (pairs // ROW_DIV).to(tl.int64)
    else:
        rows = (tl.where(m_ok, pairs, 0) // ROW_DIV).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = a + rows[:, None] * s_am + offs_k[None, :]
    w_ptr = w + e * s_we + wn.to(tl.int64)[:, None] * s_wn + offs_k[None, :]
    w_row = e32 * N + pid_n * BLOCK_N  # row of the [E*N, K] view the TMA descriptor spans
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        if MASKED:
            # K is masked too: bf16 weights are not padded, and a K that is no multiple of BLOCK_K (the
            # fixture's intermediate 96) would otherwise read the next row's values past the edge.
            k_ok = (k0 + offs_k) < KDIM
        if A_SORTED:
            at = a_desc.load([pid_m * BLOCK_M, k0])
        elif MASKED:
            at = tl.load(a_ptr + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        elif EVEN_K:
            at = tl.load(a_ptr + k0)
        else:
            at = tl.load(a_ptr + k0, mask=((k0 + offs_k) < KDIM)[None, :], other=0.0)
        if TMA:
            # rows past this expert's N (the tail tile) are the next expert's or TMA's zero fill: unstored
            wt = w_desc.load([w_row, k0])
        elif MASKED:
            wt = tl.load(w_ptr + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        elif EVEN_K:
            wt = tl.load(w_ptr + k0)
        else:
            wt = tl.load(w_ptr + k0, mask=((k0 + offs_k) < KDIM)[None, :], other=0.0)
        if FP8:
            if MASKED:
                s_a = tl.load(sa + rows * s_sam + (k0 // 128) * s_sak, mask=m_ok, other=0.0)
            else:
                s_a = tl.load(sa + rows * s_sam + (k0 // 128) * s_sak)
            if BLOCK_N <= 128:
                # The N tile lies in one 128-row weight block (tiles start at multiples of BLOCK_N): its scale
                # is one number, so the promotion is a row scale (2 multiplies a thread) and one FMA per
                # element, not a [BLOCK_M, BLOCK_N] product first; same fp32 products, same sums, bit for bit.
                s_w1 = tl.load(sw + e * s_swe + ((pid_n * BLOCK_N) // 128) * s_swn + k0 // 128)
                acc += tl.dot(at, tl.trans(wt)) * (s_a * s_w1)[:, None]
            else:
                if MASKED:
                    s_w = tl.load(sw + e * s_swe + (offs_n // 128) * s_swn + k0 // 128, mask=n_ok, other=0.0)
                else:
                    s_w = tl.load(sw + e * s_swe + (wn // 128) * s_swn + k0 // 128)
                acc += tl.dot(at, tl.trans(wt)) * (s_a[:, None] * s_w[None, :])
        else:
            acc += tl.dot(at, tl.trans(wt))
    acc += tl.load(b + e * s_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        act = _swiglu(acc, BLOCK_N, ALPHA, LIMIT)
        offs_a = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        if OUT_SORTED:
            # every slot of the block, padding included (the next GEMM's A_SORTED rows; its padding rows'
            # outputs are never stored)
            tl.store(out + slots[:, None] * s_om + offs_a[None, :], act.to(out.dtype.element_ty),
                     mask=(offs_a < N // 2)[None, :])
        else:
            tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_a[None, :], act.to(out.dtype.element_ty),
                     mask=m_ok[:, None] & (offs_a < N // 2)[None, :])
    else:
        if MUL_ROUTE:
            acc *= tl.load(rw + pairs, mask=m_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out + pairs.to(tl.int64)[:, None] * s_om + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def tma_available() -> bool:
    """Host-side TMA descriptors (triton >= 3.4)."""
    return TensorDescriptor is not None


def _weight_desc(w: torch.Tensor, block_n: int, block_k: int, cache: dict | None, pairs: bool = False):
    """The TMA descriptor of expert weights w [E, N, K] viewed as [E*N, K] with [block_n, block_k] tiles (pairs:
    as [E*N/2, 2, K] with [block_n/2, 1, block_k] tiles, the gate and the up rows of GEMM1 apart; moe_ws), from
    `cache` (MoEWeights.descs) when it holds one for this weight and tile: the weights never change, so a
    prefill's 48 grouped launches need not build 48. Keyed by storage, shape, strides and tile (a weight
    replaced in its holder gets a new one)."""
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, block_n, block_k, pairs)
    desc = cache.get(key) if cache is not None else None
    if desc is None:
        if pairs:
            desc = TensorDescriptor.from_tensor(w.view(-1, 2, w.shape[-1]), [block_n // 2, 1, block_k])
        else:
            desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])
        if cache is not None:
            cache[key] = desc
    return desc


@functools.lru_cache(maxsize=256)
def _grouped_meta(fp8, swiglu, mul_route, block_m, cfg: GemmConfig, block_k, even_k, alpha, limit, pdl: tuple,
                  out_sorted: bool = False):
    """The grouped kernel's constexprs and launch options (read-only: one mapping per distinct launch)."""
    return types.MappingProxyType(dict(
        FP8=fp8, SWIGLU=swiglu, MUL_ROUTE=mul_route, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, MASKED=cfg.masked, EVEN_K=even_k, TMA=cfg.tma, ALPHA=alpha, LIMIT=limit,
        A_SORTED=cfg.sorted_a, OUT_SORTED=out_sorted,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dict(pdl)))


def _grouped_gemm(a, sa, w, sw, b, rw, out, sorted_ids, block_expert, n_pairs, row_div, n, kdim, fp8, swiglu,
                  alpha, limit, block_m, cfg: GemmConfig, *, warmup=False, descs: dict | None = None,
                  out_sorted: bool = False):
    """One grouped GEMM (GEMM1 with SwiGLU, or GEMM2 with the routing weight when rw is given) under `cfg`.
    warmup=True compiles the kernel for these arguments without launching it (the tuner's precompile).
    descs: where the weight's TMA descriptor is kept between calls (MoEWeights.descs). cfg.sorted_a: `a` holds
    one row per slot of the sort (moe_sort.quantize_sorted), read through a TMA descriptor; out_sorted (GEMM1):
    the output rows are the slots too (the next GEMM's sorted input), else the pairs."""
    num_m = block_expert.numel()
    sa_ = sa if sa is not None else a
    sw_ = sw if sw is not None else w
    block_k = 128 if fp8 else 64
    w_desc = a_desc = w
    if cfg.tma:
        if not fp8 or TensorDescriptor is None or not w.is_contiguous():
            raise ValueError("tma=True needs FP8 weights (K padded to 128), contiguous, and triton >= 3.4")
        # the warp-specialised GEMM1 reads its gate and up rows as two half tiles (kernels/moe_ws.py)
        w_desc = _weight_desc(w, cfg.block_n, block_k, descs, pairs=cfg.ws and swiglu)
    if cfg.sorted_a:
        if not fp8 or TensorDescriptor is None or not a.is_contiguous() or a.shape[0] != sorted_ids.numel():
            raise ValueError("sorted_a=True needs the FP8 input in the sort's slots (moe_sort.quantize_sorted: "
                             f"{sorted_ids.numel()} contiguous rows, got {list(a.shape)}) and triton >= 3.4")
        a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k])
    if cfg.ws:
        if os.environ.get("KVRELAY_MOE_WS") != "1":
            raise ValueError("ws=True: the warp-specialised grouped GEMM (kernels/moe_ws.py) hung on the H200 "
                             "(triton 3.6, 806a8d7, 2026-12-05); KVRELAY_MOE_WS=1 runs it anyway, for debugging")
        if not (cfg.tma and cfg.sorted_a) or cfg.block_n > 128 or 128 % cfg.block_n or n % 2:
            raise ValueError("ws=True (warp specialisation) needs tma=True and sorted_a=True (on Hopper triton "
                             "specialises only loops whose loads are all TMA descriptors), N tiles of at most 128 "
                             f"dividing 128 and an even N (got {cfg.label()}, N {n})")
        return moe_ws.launch(a_desc, sa, w_desc, sw, b, rw, out, sorted_ids, block_expert, n_pairs, n, kdim, swiglu,
                             out_sorted, alpha, limit, block_m, cfg, pdl_kwargs(a.device), warmup=warmup)
    grid = (triton.cdiv(n, cfg.block_n) * num_m,)
    args = (a, a_desc, sa_, w, w_desc, sw_, b, rw if rw is not None else b, out, sorted_ids, block_expert, num_m, n_pairs,
            w.shape[0], n, kdim, row_div, a.stride(0), sa_.stride(0), sa_.stride(1) if sa is not None else 0,
            w.stride(0), w.stride(1), sw_.stride(0), sw_.stride(1), b.stride(0), out.stride(0))
    # pdl_kwargs is read at every launch (KVRELAY_PDL may change between them); it is part of the key
    meta = _grouped_meta(fp8, swiglu, rw is not None, block_m, cfg, block_k, kdim % block_k == 0, alpha, limit,
                         tuple(pdl_kwargs(a.device).items()), out_sorted)
    if warmup:
        return _grouped_kernel.warmup(*args, grid=grid, **meta)
    _grouped_kernel[grid](*args, **meta)


@functools.lru_cache(maxsize=64)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def grouped_config(n_pairs: int, num_experts: int, hidden: int | None = None, inter: int | None = None, *,
                   fp8: bool = True, device: torch.device | str | None = None) -> GroupedConfig:
    """Launch config of the grouped expert GEMMs: the tuned table of this GPU model and expert shape
    (kernels/moe_configs.py; written by `python -m kvrelay.bench.tune_moe`), nearest pair-count bucket,
    when there is one; else the hand heuristic (bf16 experts, CPU, GPUs without a table, shapes not in it)."""
    if fp8 and hidden is not None and inter is not None and device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        cfg = moe_configs.tuned_config(_device_name(dev), num_experts, hidden, inter, n_pairs)
        if cfg is not None:
            if not tma_available():  # the knobs that need host TMA descriptors off
                off = dict(tma=False, sorted_a=False, ws=False)
                cfg = dataclasses.replace(cfg, w1=dataclasses.replace(cfg.w1, **off),
                                          w2=dataclasses.replace(cfg.w2, **off))
            return cfg
    return moe_configs.heuristic_config(n_pairs, num_experts)


def _moe_grouped(x, ids, route_w, ex: MoEWeights, alpha, limit, block_m=None, block_n=None, num_warps=None,
                 num_stages=None, *, config: GroupedConfig | None = None, combine: bool = True):
    """The grouped expert path under `config` (default: grouped_config for this shape and device). The
    block_m/block_n/num_warps/num_stages overrides (bench.kernels' side-by-side configs) apply to both
    GEMMs with the knobs off, i.e. the original kernel."""
    t, k = ids.shape
    n_pairs = t * k
    two_i, h = ex.w1.shape[1], ex.hidden
    if config is None:
        config = grouped_config(n_pairs, ex.num_experts, h, two_i // 2, fp8=ex.fp8, device=x.device)
    if any(v is not None for v in (block_m, block_n, num_warps, num_stages)):
        g = GemmConfig(block_n or config.w1.block_n, num_warps or config.w1.num_warps,
                       num_stages or config.w1.num_stages)
        config = GroupedConfig(block_m or config.block_m, g, g, source="explicit")
    block_m = config.block_m
    sorted_ids, block_expert, _ = sort_by_expert(ids, ex.num_experts, block_m)
    if not ex.fp8 and (config.w1.sorted_a or config.w2.sorted_a):
        raise ValueError("sorted_a configs are FP8-only")
    if config.w1.sorted_a:  # the tokens' rows quantised straight into the sort's slots
        xa, xs = quantize_sorted(x, sorted_ids, block_expert, ex.num_experts, n_pairs, k, ex.w1.shape[2])
    elif ex.fp8:
        xa, xs = quantize_act_1x128(x, ex.w1.shape[2], m_major=False)
    else:
        xa, xs = x, None
    # GEMM2 reading its rows in the sort's order: GEMM1 writes them so (every slot), and they are quantised as
    # they lie; else one row per pair
    out_sorted = config.w2.sorted_a
    act = torch.empty(sorted_ids.numel() if out_sorted else n_pairs, two_i // 2, dtype=torch.bfloat16,
                      device=x.device)
    _grouped_gemm(xa, xs, ex.w1, ex.s1, ex.b1, None, act, sorted_ids, block_expert, n_pairs, k, two_i,
                  ex.w1.shape[2], ex.fp8, True, alpha, limit, block_m, config.w1, descs=ex.descs,
                  out_sorted=out_sorted)
    if out_sorted:  # the used blocks' slots only (the empty ones at the end are never read), padding zeros
        aa, as_ = quantize_sorted(act, sorted_ids, block_expert, ex.num_experts, n_pairs, 1, ex.w2.shape[2],
                                  slot_rows=True)
    elif ex.fp8:
        aa, as_ = quantize_act_1x128(act, ex.w2.shape[2], m_major=False)
    else:
        aa, as_ = act, None
    # The weighted pair outputs of a bf16 model are stored bf16: each rounded once before the fp32 sum (here,
    # or in the next residual add, kernels.fused.add_rms_norm, when uncombined), as the reference rounds each
    # expert's output before adding it (in bf16). fp32 pairs were 377 MB written and read again per layer of
    # an 8192-token prefill (2 x ~45 us at the copy ceiling). Both combine modes round alike, so the fused
    # glue and the unfused/multi-rank path (combine=True) differ only in the order of the sum, as before.
    y = torch.empty(n_pairs, h, dtype=pair_dtype(x), device=x.device)
    _grouped_gemm(aa, as_, ex.w2, ex.s2, ex.b2, route_w.reshape(-1), y, sorted_ids, block_expert, n_pairs, 1, h,
                  ex.w2.shape[2], ex.fp8, False, alpha, limit, block_m, config.w2, descs=ex.descs)
    return y.view(t, k, h).float().sum(1).to(torch.bfloat16) if combine else y.view(t, k, h)


def _moe_torch_grouped(x, ids, route_w, ex: MoEWeights, alpha, limit):
    """bf16 experts through torch._grouped_mm (cuBLAS grouped GEMM) + torch elementwise ops."""
    if ex.fp8:
        raise ValueError("torch._grouped_mm path is bf16-only (no 128x128 block scales in _scaled_grouped_mm)")
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    se = flat[order]
    counts = torch.zeros(ex.num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h1 = torch._grouped_mm(xs, ex.w1.transpose(1, 2), offs=offs) + ex.b1[se]
    g = h1[:, 0::2].clamp(max=limit)
    u = h1[:, 1::2].clamp(-limit, limit)
    act = (g * torch.sigmoid(alpha * g) * (u + 1)).to(torch.bfloat16)
    y = torch._grouped_mm(act, ex.w2.transpose(1, 2), offs=offs) + ex.b2[se]
    y = y.float() * route_w.reshape(-1)[order].float()[:, None]
    out = torch.zeros(t * k, y.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y
    return out.view(t, k, -1).sum(1).to(torch.bfloat16)



def moe_experts(x: torch.Tensor, ids: torch.Tensor, route_w: torch.Tensor, ex: MoEWeights, *,
                path: str = "auto", alpha: float = 1.702, limit: float = 7.0, combine: bool = True,
                norm_counters: torch.Tensor | None = None,
                fused_counters: torch.Tensor | None = None) -> torch.Tensor | MoePending:
    """Expert mixture for given routing. x [T, H] bf16; ids [T, k]; route_w [T, k] -> [T, H] bf16.
    combine=False (gemv and grouped paths): the weighted expert outputs [T, k, H] before their sum, for a
    caller that fuses the combine into its next kernel (kernels.fused.add_rms_norm), in
    moe_gemv.pair_dtype(x) on both paths. With norm_counters (moe_gemv.new_norm_counters(), combine=False; the
    engine's decode step) the gemv path may instead return a moe_gemv.MoePending: GEMV2 left to the consumer,
    which fuses the next residual add + norm into it (moe_gemv.moe_gemv says when). fused_counters
    (moe_fused.new_fused_counters()): the gemv path's two GEMVs in one launch where it can (kernels/moe_fused.py)."""
    if ex.mx:  # MXFP4 experts: their own kernels (the opt-in decode fusions are FP8/bf16-only)
        return moe_mxfp4(x, ids, route_w, ex, alpha, limit, combine=combine, path=path)
    if path == "auto":
        path = "gemv" if ids.numel() <= GEMV_MAX_PAIRS else "grouped"
    if x.shape[0] == 0:
        if not combine:
            return torch.empty(0, ids.shape[1], ex.hidden, dtype=pair_dtype(x), device=x.device)
        return torch.empty(0, ex.hidden, dtype=torch.bfloat16, device=x.device)
    if path == "gemv":
        fused = None if fused_counters is None else moe_fused.fused_gemvs(fused_counters)
        return moe_gemv(x, ids, route_w, ex, alpha, limit, combine=combine, norm_counters=norm_counters, fused=fused)
    if path == "grouped":
        return _moe_grouped(x, ids, route_w, ex, alpha, limit, combine=combine)
    if not combine:
        raise ValueError(f"MoE path {path} always combines")
    if path == "torch":
        return _moe_torch_grouped(x, ids, route_w, ex, alpha, limit)
    raise ValueError(f"unknown MoE path {path}")


def moe_forward(h: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor, ex: MoEWeights, k: int, *,
                path: str = "auto", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """One MoE block on normed input h [T, H] (residual not included), routed as the engine routes
    (engine/layers/moe.py): the fused router kernel at decode sizes on a GPU, cuBLAS + route_topk above."""
    if h.is_cuda and h.shape[0] <= router.ROUTE_MAX_TOKENS:
        w, ids = router.router_route(h, gate_w, gate_b, k, _counters(h.device))
    else:
        w, ids = route_topk(torch.nn.functional.linear(h, gate_w, gate_b), k)  # bf16 like the reference
    return moe_experts(h, ids, w, ex, path=path, alpha=alpha, limit=limit)


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return router.new_counters(device)
