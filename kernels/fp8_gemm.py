"""FP8 (e4m3) block-scaled GEMM with bias on Hopper: y = quant_1x128(x) @ w^T * scales + bias.

Same numbers as kernels.fp8.fp8_block_linear_ref (activations 1x128, weights 128x128, fp32 accumulation
per K block, scaled, summed, + bias, bf16). Backends:
- "cublas": torch._scaled_mm blockwise. Layout that is right (h200-notes; the obvious block-scale layout
  runs fast and is WRONG): A fp8 [M, K] with 1x128 scales [M, K/128] M-major; B = w.t(); its block scales
  expanded to one per output column, [K/128, N] contiguous. cuBLAS has no bias here, so bias is one extra
  in-place pass over the output.
- "triton": a block-scaled Triton GEMM whose epilogue adds the bias before the bf16 store (no extra pass).
- "gemv-*": kernels/fp8_gemv.py, a CUDA-core GEMV over narrow N tiles (optionally split-K) for decode
  batches (M <= 8).
- "deepgemm": only if `deep_gemm` is importable (it is not on our H200 image).
`Fp8BlockLinear(backend="auto")` times the available backends once per M bucket on first use and keeps the
faster one (never while a CUDA graph is being captured), except at batch 1 for a shape in M1_PINNED (or
KVRELAY_FP8_M1), whose backend was chosen by an in-model A/B and is only checked against cuBLAS.
K is padded to a multiple of 128 once at load time: both kernels consume whole 128-wide K blocks.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from .fp8_gemv import Fp8GemvLaunch, new_counters, triton_fp8_gemv
from .fp8_quant import quant_1x128
from .pdl import enter, pdl_kwargs

BLOCK = 128
FP8 = torch.float8_e4m3fn
_log = logging.getLogger(__name__)


@triton.jit
def _quant_act_kernel(x, q, s, M, K, s_xm, s_qm, s_sm, s_sk, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load (x is the previous kernel's) or store
    # One program per (row, 128-wide K block); columns >= K and rows >= M (padding) are written as zeros.
    m = tl.program_id(0)
    kb = tl.program_id(1)
    offs = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs < K) & (tl.zeros([BLOCK_K], tl.int32) + m < M)
    v = tl.load(x + m.to(tl.int64) * s_xm + offs, mask=ok, other=0.0).to(tl.float32)
    qv, scale = quant_1x128(v, 0)
    tl.store(q + m.to(tl.int64) * s_qm + offs, qv.to(q.dtype.element_ty))
    tl.store(s + m * s_sm + kb * s_sk, scale)


@triton.jit
def _quant_act_tile_kernel(x, q, s, M, MP, K, s_xm, s_qm, s_sm, s_sk, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    enter(USE_PDL)  # kernels/pdl.py: before any load or store
    # Prefill sizes: one program per (BLOCK_M rows, 128-wide K block), the same math per 1x128 group as
    # _quant_act_kernel (fp8_quant.quant_1x128, one cast); rows in [M, MP) are padding
    # (zeros, floor scale), rows >= MP of the last tile are not stored.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    offs = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < M) & (offs[None, :] < K)
    r64 = rows.to(tl.int64)[:, None]
    v = tl.load(x + r64 * s_xm + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    qv, scale = quant_1x128(v, 1)
    keep = rows < MP
    tl.store(q + r64 * s_qm + offs[None, :], qv.to(q.dtype.element_ty), mask=keep[:, None])
    tl.store(s + rows * s_sm + kb * s_sk, scale, mask=keep)


# Row counts from which quantize_act_1x128 launches the tiled kernel: decode (<= 64 tokens, <= 256 MoE
# pairs, inside CUDA graphs) keeps the one-row programs it was tuned with. At prefill sizes those are
# 750k programs of 256 bytes for the MoE's [32768, 2880] input (243 us a call on the H200 against a ~70 us
# bandwidth floor, bench.profile_prefill); BLOCK_M-row tiles move 16 KB a program.
QUANT_TILE_MIN_ROWS = 512
QUANT_TILE = (64, 4)  # (BLOCK_M, num_warps); bench.kernels --only glue times the alternatives


def quantize_act_1x128(x: torch.Tensor, k_padded: int | None = None, m_major: bool = True, *,
                       tile: tuple[int, int] | None = None):
    """x [M, K] bf16 -> (fp8 [Mp, Kp], scale f32 [Mp, Kp/128]); matches kernels.fp8.quantize_act_1x128 on
    the first M rows and K columns (padding is zeros). m_major=True gives cuBLAS's layout: scale stride
    (1, Mp) with Mp = M rounded up to 4, because cuBLAS rejected (NOT_SUPPORTED, seen at M=37) an
    M-major scale whose leading dimension is not 16-byte aligned; otherwise Mp = M, row-major scale.
    tile: (rows per program, warps) of the tiled launch, (1, 1) for the one-row programs; default by M
    (QUANT_TILE from QUANT_TILE_MIN_ROWS rows). Every launch gives the same bits."""
    m, k = x.shape
    kp = k_padded or triton.cdiv(k, BLOCK) * BLOCK
    kb = kp // BLOCK
    mp = -(-m // 4) * 4 if m_major else m
    q = torch.empty(mp, kp, dtype=FP8, device=x.device)
    s = torch.empty(kb, mp, dtype=torch.float32, device=x.device).t() if m_major else \
        torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if tile is None:
        tile = QUANT_TILE if m >= QUANT_TILE_MIN_ROWS else (1, 1)
    block_m, num_warps = tile
    if mp and block_m == 1:
        _quant_act_kernel[(mp, kb)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                    BLOCK_K=BLOCK, num_warps=num_warps, **pdl_kwargs(x.device))
    elif mp:
        _quant_act_tile_kernel[(triton.cdiv(mp, block_m), kb)](
            x, q, s, m, mp, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCK_M=block_m,
            BLOCK_K=BLOCK, num_warps=num_warps, **pdl_kwargs(x.device))
    return q, s


@triton.jit
def _fp8_gemm_kernel(a, b, sa, sb, bias, c, M, N, KB,
                     s_am, s_bn, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP_M: tl.constexpr):
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order: GROUP_M row-blocks walk the N blocks together so B tiles stay in L2.
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptr = a + offs_m.to(tl.int64)[:, None] * s_am + offs_k[None, :]
    b_ptr = b + offs_n.to(tl.int64)[:, None] * s_bn + offs_k[None, :]
    sa_ptr = sa + offs_m * s_sam
    sb_ptr = sb + (offs_n // 128) * s_sbn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(KB):
        at = tl.load(a_ptr, mask=m_ok[:, None], other=0.0)
        bt = tl.load(b_ptr, mask=n_ok[:, None], other=0.0)
        s_a = tl.load(sa_ptr + kb * s_sak, mask=m_ok, other=0.0)
        # Each 128-wide K block is summed exactly in fp32 by the tensor cores, then scaled: the
        # DeepSeek-style promotion that keeps fp8 accumulation error from growing with K.
        if BLOCK_N <= 128:
            # the tile lies in one 128-row weight block: one weight scale, so a row scale (as the grouped
            # expert GEMM, kernels/moe.py; tests/cpu/test_grouped_sass.py shows the instructions it saves)
            s_b1 = tl.load(sb + ((pid_n * BLOCK_N) // 128) * s_sbn + kb * s_sbk)
            acc += tl.dot(at, tl.trans(bt)) * (s_a * s_b1)[:, None]
        else:
            s_b = tl.load(sb_ptr + kb * s_sbk, mask=n_ok, other=0.0)
            acc += tl.dot(at, tl.trans(bt)) * (s_a[:, None] * s_b[None, :])
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c + offs_m.to(tl.int64)[:, None] * s_cm + offs_n[None, :], acc.to(c.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def triton_fp8_gemm(a_fp8, sa, w_fp8, w_scale, bias=None, out=None, *, block_m=128, block_n=128,
                    group_m=8, num_warps=8, num_stages=4):
    """a_fp8 [M, Kp], sa [M, Kp/128] (any strides), w_fp8 [N, Kp], w_scale [ceil(N/128), Kp/128]."""
    m, kp = a_fp8.shape
    n = w_fp8.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a_fp8.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](a_fp8, w_fp8, sa, w_scale, bias if bias is not None else out, out, m, n, kp // BLOCK,
                           a_fp8.stride(0), w_fp8.stride(0), sa.stride(0), sa.stride(1),
                           w_scale.stride(0), w_scale.stride(1), out.stride(0),
                           HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m,
                           num_warps=num_warps, num_stages=num_stages)
    return out


def cublas_column_scales(w_scale: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(N/128), Kp/128] block scales -> [Kp/128, N] contiguous, one scale per output column."""
    return w_scale.float().repeat_interleave(BLOCK, 0)[:n].t().contiguous()


def cublas_fp8_gemm(a_fp8, sa_m_major, w_fp8, sb_cols, bias=None, bias_pass: bool = False):
    """cuBLAS blockwise GEMM. The bias= argument works on torch 2.11 + cuBLAS 13 (H200, 2026-11-29:
    871 TFLOP/s at 8192x2880x5120, one bf16 ulp from the separate pass, which rounds twice);
    bias_pass=True keeps the separate in-place add for comparison."""
    if bias is not None and not bias_pass:
        return torch._scaled_mm(a_fp8, w_fp8.t(), scale_a=sa_m_major, scale_b=sb_cols, bias=bias,
                                out_dtype=torch.bfloat16)
    out = torch._scaled_mm(a_fp8, w_fp8.t(), scale_a=sa_m_major, scale_b=sb_cols, out_dtype=torch.bfloat16)
    if bias is not None:
        out.add_(bias)
    return out


def _deep_gemm():
    try:
        import deep_gemm  # noqa: F401  (never installed by us; used only where it already exists)
        return deep_gemm
    except Exception:
        return None


def _pad_k(w: torch.Tensor, kp: int) -> torch.Tensor:
    if w.shape[-1] == kp:
        return w.contiguous()
    out = torch.zeros(*w.shape[:-1], kp, dtype=w.dtype, device=w.device)
    out[..., : w.shape[-1]] = w
    return out


class Fp8BlockLinear:
    """A served FP8 linear layer: weights prepared once (K padded, cuBLAS scale layout built)."""

    BACKENDS = ("cublas", "triton")
    # The Triton GEMM's tiles per backend name: (block_m, block_n, num_warps, num_stages). At decode sizes
    # a 128x128 tile leaves most SMs idle (N=5120 is 40 programs) and cuBLAS reached only ~2 TB/s on the
    # QKV/O projections at batch 1 (7 us for 14.7 MB, bench/results/profile-decode-*): 16-row tiles with
    # narrow N spread the weight stream over every SM. They are timed, like the others, for M buckets up
    # to SMALL_M only, and chosen only where measured faster.
    TRITON_TILES = {"triton": (128, 128, 8, 4), "triton-m16n32": (16, 32, 4, 4), "triton-m16n64": (16, 64, 4, 4)}
    SMALL_M = 64
    # The FP8 GEMV's launches (kernels/fp8_gemv.py), timed for M buckets up to GEMV_MAX_M (decode batch
    # sizes). The first GEMV (3-D tile, no split-K) was 2-300x slower than cuBLAS's 7.3 us at M=1..8 on 20b's
    # QKV and O (33d1582, bench/results/kernels-20261201-174833.json); this one is moe_gemv's 2-D tile plus
    # split-K. The candidates span moe_gemv's measured best (n32-k512-w2-s2: GEMM1 at 78% of the copy
    # ceiling) and split-K enough for N=2880 (90 32-row tiles) to fill 132 SMs several times over; the
    # 4- and 8-split ones hold <= 64 weights a thread (no spills at M=2..8, ptxas on sm_90a; the 256 of
    # n32-k512-w2 spill from M=2 on, fine at M=1).
    # bench/sweep_gemv.py --dense times these and more against cuBLAS under CUDA graphs. The last one is the
    # batch-1 O projection's (M1_PINNED), here so that the GEMV tests cover it.
    GEMV_TILES = {f"gemv-{l.label()}": l for l in (
        Fp8GemvLaunch(32, 512, 1, num_warps=2), Fp8GemvLaunch(32, 512, 2, num_warps=2),
        Fp8GemvLaunch(32, 256, 4, num_warps=4), Fp8GemvLaunch(16, 512, 4, num_warps=4),
        Fp8GemvLaunch(16, 256, 8, num_warps=2), Fp8GemvLaunch(64, 512, 4, num_warps=8),
        Fp8GemvLaunch(32, 256, 8, num_warps=4))}
    # `auto` times the GEMV launches only when KVRELAY_FP8_GEMV (default GEMV_DEFAULT) is "1": their
    # compiles cost a cold server start time for nothing until the sweep shows them faster than cuBLAS.
    # Flipping the default after the GPU sweep is this one line ("1"; KVRELAY_FP8_GEMV=0 then opts out).
    GEMV_DEFAULT = "0"
    GEMV_MAX_M = 8
    # Batch 1 (M bucket 1) per weight shape (N, K): a backend fixed by an in-model A/B instead of `auto`'s
    # timing of each call alone (do_bench cannot see the PDL overlap of the decode chain, and its pick between
    # launches within ~0.3 us of each other changes from run to run). KVRELAY_FP8_M1 overrides it for A/B
    # runs: "NxK=backend,..." (e.g. "2880x4096=gemv-n16-k512-s8-w2-st2,5120x2880=cublas"); "auto" times as
    # before. A fixed backend is still checked against cuBLAS on a random input before it is kept.
    # H200, b69d296, batch-1 decode at 8192 pipelined, back to back on one machine (bench/results/ab/README.md):
    # O (4096 -> 2880) on gemv-n32-k256-s8-w4-st2 20b 1.743 vs 1.792 ms (cuBLAS), 120b 2.484 vs 2.554 ms;
    # n16-k512-s8-w2-st2 1.757 / 2.501. QKV (2880 -> 5120) on any of three GEMV launches was slower than
    # cuBLAS (+0.02..0.04 ms 20b), so it keeps `auto`.
    M1_PINNED: dict[tuple[int, int], str] = {(2880, 4096): "gemv-n32-k256-s8-w4-st2"}

    def __init__(self, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: str = "auto", choice_cache: dict[int, str] | None = None):
        n, k = w_fp8.shape
        self.n, self.k = n, k
        self.kp = triton.cdiv(k, BLOCK) * BLOCK
        if tuple(w_scale.shape) != (triton.cdiv(n, BLOCK), self.kp // BLOCK):
            raise ValueError(f"w_scale {list(w_scale.shape)} does not match weight [{n}, {k}]")
        # Zero padding columns: their fp8 zeros contribute nothing whatever their scale.
        self.w = _pad_k(w_fp8, self.kp)
        self.w_scale = w_scale.float().contiguous()
        self.sb_cols = cublas_column_scales(self.w_scale, n)
        self.bias = bias
        if backend != "auto":
            self._check_backend(backend)
        self.backend = backend
        # split-K GEMV arrival counters (zero between launches), allocated here: never during a graph capture
        self._counters = new_counters(n, self.w.device, self.GEMV_MAX_M)
        # M bucket -> backend. Layers of one shape may share one dict (`choice_cache`), so a model with
        # 24 identical projections times each bucket once rather than 24 times.
        self._choice: dict[int, str] = {} if choice_cache is None else choice_cache

    @classmethod
    def _check_backend(cls, backend: str) -> None:
        """ValueError unless `backend` names one: cublas, a Triton tile, or gemv-<Fp8GemvLaunch label>."""
        if backend in ("cublas", *cls.TRITON_TILES, *cls.GEMV_TILES):
            return
        if not backend.startswith("gemv-"):
            raise ValueError(f"unknown backend {backend!r}: cublas, {', '.join(cls.TRITON_TILES)} or "
                             "gemv-<launch label>")
        Fp8GemvLaunch.parse(backend[len("gemv-"):])

    @staticmethod
    @functools.cache  # _run's lookup on every eager call: a label is parsed once
    def _gemv_launch(backend: str) -> Fp8GemvLaunch:
        return Fp8BlockLinear.GEMV_TILES.get(backend) or Fp8GemvLaunch.parse(backend[len("gemv-"):])

    def _m1_pin(self) -> str | None:
        """The backend fixed for M bucket 1 of this layer's shape (KVRELAY_FP8_M1 first, then M1_PINNED)."""
        pins = dict(self.M1_PINNED)
        for item in filter(None, os.environ.get("KVRELAY_FP8_M1", "").split(",")):
            shape, sep, backend = item.partition("=")
            n, x, k = shape.strip().partition("x")
            if not sep or not x or not n.isdigit() or not k.isdigit():
                raise ValueError(f"KVRELAY_FP8_M1: {item!r} is not NxK=backend")
            pins[(int(n), int(k))] = backend.strip()
        pin = pins.get((self.n, self.k))
        if pin in (None, "auto"):
            return None
        self._check_backend(pin)
        return pin

    def _run(self, backend: str, xq, sx, m: int | None = None):
        """[>= m, N]: the GEMMs compute every (padding) row of xq, the GEMV only the first m."""
        if backend == "cublas":
            return cublas_fp8_gemm(xq, sx, self.w, self.sb_cols, self.bias)
        if backend.startswith("gemv-"):
            # past GEMV_MAX_M rows (an explicit gemv backend) a split-K launch zeroes counters of its own
            return triton_fp8_gemv(xq, sx, self.w, self.w_scale, self.bias, m=m, launch=self._gemv_launch(backend),
                                   counters=self._counters if (m or xq.shape[0]) <= self.GEMV_MAX_M else None)
        bm, bn, nw, ns = self.TRITON_TILES[backend]
        return triton_fp8_gemm(xq, sx, self.w, self.w_scale, self.bias, block_m=bm, block_n=bn, num_warps=nw,
                               num_stages=ns)

    def _pick(self, m: int, xq, sx) -> str:
        if self.backend != "auto":
            return self.backend
        bucket = 1 << max(0, (m - 1).bit_length())
        if bucket in self._choice:
            return self._choice[bucket]
        if torch.cuda.is_current_stream_capturing():
            return "cublas"
        times = {}
        names = self.BACKENDS + (tuple(n for n in self.TRITON_TILES if n != "triton") if bucket <= self.SMALL_M else ())
        if bucket <= self.GEMV_MAX_M and os.environ.get("KVRELAY_FP8_GEMV", self.GEMV_DEFAULT) == "1":
            names += tuple(self.GEMV_TILES)
        pin = self._m1_pin() if bucket == 1 else None
        if pin is not None:  # checked against cuBLAS below (first), not timed: kept unless it disagrees
            names = ("cublas", pin) if pin != "cublas" else ("cublas",)
        # Candidates run on a random input of this size, not the caller's: a warm-up step's activations
        # may be NaN (attention over an uninitialised KV pool), which would make every check fail. The
        # kernels' time does not depend on the values. They run through _run, i.e. launched as they will be
        # served: the GEMV with PDL where kernels/pdl.py has it on (read at each launch, and the choice is
        # made before any graph capture, under the same setting). do_bench's L2 flush before each timed
        # launch is a plain torch kernel, so the times leave out the overlap PDL buys in the decode chain.
        gen = torch.Generator(device=xq.device).manual_seed(m)
        xq, sx = quantize_act_1x128(torch.randn(m, self.k, generator=gen, device=xq.device).bfloat16(), self.kp)
        first = first_name = None
        for name in names:
            try:
                out = self._run(name, xq, sx, m)[:m].float()
                # A candidate must agree with the first backend that ran (cuBLAS where it can) before its
                # speed counts: a kernel miscompiled for this shape/GPU is never picked.
                if first is None:
                    first, first_name = out, name
                elif not (out - first).norm() <= 1e-2 * first.norm() + 1e-6:
                    _log.warning("Fp8BlockLinear [%d, %d] M=%d: backend %s disagrees with %s, not used",
                                 self.n, self.k, m, name, first_name)
                    continue
                times[name] = None if pin is not None else triton.testing.do_bench(
                    lambda: self._run(name, xq, sx, m), warmup=5, rep=20, return_mode="median")
            except Exception:  # a backend that cannot run this shape is simply not chosen
                if name == pin:
                    _log.warning("Fp8BlockLinear [%d, %d]: pinned M=1 backend %s failed, cuBLAS used",
                                 self.n, self.k, pin, exc_info=True)
                continue
        # `times` holds the backends that ran and agreed (untimed when pinned)
        self._choice[bucket] = ((pin if pin in times else "cublas") if pin is not None
                                else min(times, key=times.get))
        return self._choice[bucket]

    def run_quantized(self, xq: torch.Tensor, sx: torch.Tensor, m: int) -> torch.Tensor:
        """The product of an input already quantised as quantize_act_1x128(x, self.kp) returns it (e.g. by
        kernels.fused.add_rms_norm): [m, N] bf16, the M padding rows dropped."""
        return self._run(self._pick(m, xq, sx), xq, sx, m)[:m]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        xq, sx = quantize_act_1x128(x2, self.kp)
        return self.run_quantized(xq, sx, x2.shape[0]).reshape(*lead, self.n)


def fp8_block_linear(x, w_fp8, w_scale, bias=None, backend: str = "cublas"):
    """Drop-in for kernels.fp8.fp8_block_linear_ref (prepares the weight on every call: for tests and
    tools; the engine holds an Fp8BlockLinear per layer)."""
    return Fp8BlockLinear(w_fp8, w_scale, bias, backend=backend)(x)
