"""The MoE router at decode sizes in one launch: the router's logits (a GEMV) and the top-k + softmax over
them (router_route), or also the residual add + RMSNorm in front of the MoE (add_rms_norm_route, what a
decode step runs: three launches become one). Routing alone was two launches (kernels.fused.router_logits,
then kernels.moe.route_topk), ~4.9 + 1.5 us a layer at batch 1 on the H200, beside a 3.5 us add + norm
(bench/results/profile-decode-gpt-oss-20b-b1-8k-graph-*.json).

Each program computes BLOCK_E logits of one token (router_route: exactly as router_logits does, same
tiles, so the same fp32 sums and one rounding to bf16), writes them, and counts itself in the token's
arrival counter; the program that arrives last reads the token's whole logit row back (from L2) and
routes it with topk_softmax, kernels.moe's route kernel's own code, then zeroes the counter for the next
launch. So router_route equals router_logits + route_topk bit for bit, and replay is deterministic: which
program routes changes nothing it computes. add_rms_norm_route recomputes the (few-KB) norm in every
program and sums each logit in one K step, so its logits may differ from router_logits' by the fp32 order.
The counters ([ROUTE_MAX_TOKENS] int32, zero between launches) belong to the caller, allocated before any
CUDA-graph capture (engine/layers/moe.py: one per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused import router_logit_tile
from .pdl import enter, launch_dependents, pdl_kwargs, wait

ROUTE_MAX_TOKENS = 64  # = kernels.fused.ROUTER_GEMV_MAX_TOKENS: above it cuBLAS's GEMM is the better router
_BLOCK_E, _BLOCK_K = 4, 1024  # router_logits' tiles: equal sums need equal tiles
# add_rms_norm_route's warps: H200, batch 1, CUDA-graph replay, 4 experts a program: 2.99 us with 4 warps vs
# 3.18 with 8 for 32 experts (20b), 3.78 vs 4.61 for 128 (120b); at 8 and 64 tokens 4 warps were as fast or
# faster; 2 experts a program gained <= 3% at 1 token and lost 30% at 64, 8 were slower
# (bench/results/sweep-glue-*.json). The logits' fp32 sum order depends on the launch (see the docstring).
_ROUTE_WARPS = 4


@triton.jit
def topk_softmax(v, e, K: tl.constexpr, E_P2: tl.constexpr):
    """Top-K of each row of v [R, E_P2] (fp32 holding bf16 values, -inf where no expert), then the softmax
    over the K: (weights fp32 [R, K], ids int32 [R, K]) in descending order, ties to the lower id."""
    kk = tl.arange(0, K)
    vals = tl.zeros([v.shape[0], K], tl.float32)
    ids = tl.zeros([v.shape[0], K], tl.int32)
    for j in tl.static_range(K):
        m = tl.max(v, 1)
        # lowest index among equal maxima: deterministic ties
        idx = tl.min(tl.where(v == m[:, None], e[None, :], E_P2), 1)
        vals = tl.where(kk[None, :] == j, m[:, None], vals)
        ids = tl.where(kk[None, :] == j, idx[:, None], ids)
        v = tl.where(e[None, :] == idx[:, None], float("-inf"), v)
    p = tl.exp(vals - tl.max(vals, 1)[:, None])
    return p / tl.sum(p, 1)[:, None], ids


@triton.jit
def _router_route_kernel(x_ptr, w_ptr, b_ptr, logit_ptr, cnt_ptr, w_out, id_out, E, K, s_xt, s_we,
                         HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, E_P2: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # kernels/pdl.py: before any load (x is the previous kernel's; the K loop loads x and w together), the
    # logit store and the counter's atomic (see _route_when_last)
    enter(USE_PDL)
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    acc = router_logit_tile(x_ptr, w_ptr, b_ptr, t, offs_e, e_ok, K, s_xt, s_we, HAS_BIAS, BLOCK_E, BLOCK_K)
    row = logit_ptr + t.to(tl.int64) * E
    tl.store(row + offs_e, acc.to(logit_ptr.dtype.element_ty), mask=e_ok)
    _route_when_last(row, cnt_ptr, t, w_out, id_out, E, TOP_K, E_P2)


@triton.jit
def _route_when_last(row, cnt_ptr, t, w_out, id_out, E, TOP_K: tl.constexpr, E_P2: tl.constexpr):
    # Every thread's logit store is done before the one release below (the classic last-block pattern:
    # barrier, then a gpu-scope acq_rel atomic); the last arrival's acquire then sees every program's row.
    # Under PDL (kernels/pdl.py) the callers' programs all passed griddepcontrol.wait first, so this
    # launch's atomics start only after the previous kernel COMPLETED, and every kernel in between waited
    # for its own predecessor: the last launch on these counters (its final .cg reads of its row and its
    # zeroing xchg) is complete and visible before any increment here. A kernel launched early after this
    # one (its trigger fired at entry) waits for all of this launch, the last arrival's routing
    # and reset included, before it reads the weights and ids, so the early trigger cannot expose a
    # half-routed row or a counter not yet back at zero.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        e = tl.arange(0, E_P2)
        # .cg: read from L2, never a stale L1 line
        v = tl.load(row + e, mask=e < E, other=0.0, cache_modifier=".cg").to(tl.float32)
        v = tl.where(e < E, v, float("-inf"))
        w, ids = topk_softmax(tl.reshape(v, [1, E_P2]), e, TOP_K, E_P2)
        kk = tl.arange(0, TOP_K)
        o = t.to(tl.int64) * TOP_K + kk[None, :]
        tl.store(w_out + o, w.to(w_out.dtype.element_ty))
        tl.store(id_out + o, ids.to(tl.int64))
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")


@triton.jit
def _add_norm_route_kernel(x_ptr, d_ptr, nw_ptr, xo_ptr, h_ptr, w_ptr, b_ptr, logit_ptr, cnt_ptr, w_out, id_out,
                           H, E, eps, s_x, s_d, s_xo, s_h, s_we, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr,
                           E_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    # kernels.fused.add_rms_norm's DELTA=1 math (torch's x + delta rounded once, then RMSNorm) in every
    # program of token t (the row is a few KB, read from L2), program 0 storing the results; then this
    # program's BLOCK_E router logits from the normed bf16 row still in registers, and the routing.
    t = tl.program_id(0)
    eb = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    # The layer's parameters (norm weight, router weight and bias: never written by a decode step, see
    # add_rms_norm_route) are loaded before the PDL wait: with PDL these loads (the router tile is the bulk of
    # this kernel's bytes) overlap the previous kernel's tail. Everything else comes after the wait.
    nw = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wt = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * s_we + offs[None, :], mask=e_ok[:, None] & m[None, :],
                 other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    wait(USE_PDL)
    launch_dependents(USE_PDL)  # kernels/pdl.py: right after the wait
    x = tl.load(x_ptr + t.to(tl.int64) * s_x + offs, mask=m, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + t.to(tl.int64) * s_d + offs, mask=m, other=0.0).to(tl.float32)
    x = (x + d).to(x_ptr.dtype.element_ty).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (nw * (x * inv)).to(x_ptr.dtype.element_ty)
    if eb == 0:
        tl.store(xo_ptr + t.to(tl.int64) * s_xo + offs, x.to(xo_ptr.dtype.element_ty), mask=m)
        tl.store(h_ptr + t.to(tl.int64) * s_h + offs, y, mask=m)
    acc = tl.sum(wt * y.to(tl.float32)[None, :], 1)
    if HAS_BIAS:
        acc += bias
    row = logit_ptr + t.to(tl.int64) * E
    tl.store(row + offs_e, acc.to(logit_ptr.dtype.element_ty), mask=e_ok)
    _route_when_last(row, cnt_ptr, t, w_out, id_out, E, TOP_K, E_P2)


def new_counters(device) -> torch.Tensor:
    """Arrival counters for router_route (zero; each launch leaves them zero)."""
    return torch.zeros(ROUTE_MAX_TOKENS, dtype=torch.int32, device=device)


def router_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                 counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk(router_logits(x, weight, bias), k) in one launch: x [T, H] (T <= ROUTE_MAX_TOKENS),
    weight [E, H], bias [E] -> (weights bf16 [T, k], expert ids int64 [T, k]), bit for bit the same."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    t, h = x.shape
    e = weight.shape[0]
    if t > counters.numel():
        raise ValueError(f"router_route: {t} tokens, counters for {counters.numel()}")
    w = torch.empty(t, k, dtype=torch.bfloat16, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    if t:
        logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
        _router_route_kernel[(t, triton.cdiv(e, _BLOCK_E))](
            x, weight, bias if bias is not None else weight, logits, counters, w, ids, e, h, x.stride(0),
            weight.stride(0), HAS_BIAS=bias is not None, TOP_K=k, E_P2=triton.next_power_of_2(e),
            BLOCK_E=_BLOCK_E, BLOCK_K=_BLOCK_K, **pdl_kwargs(x.device))
    return w, ids


def add_rms_norm_route(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None, k: int, counters: torch.Tensor,
                       *, logits: torch.Tensor | None = None, block_e: int = _BLOCK_E, num_warps: int = _ROUTE_WARPS):
    """The residual add + RMSNorm before the MoE and its router in one launch (decode sizes):
    x, delta [T, H] -> (x + delta, normed h, route weights bf16 [T, k], expert ids int64 [T, k]).
    x + delta and h are kernels.fused.add_rms_norm(x, delta, norm_weight, eps)'s (the norm's fp32 sum of
    squares may be ordered differently); the logits are the router's on h up to the order of their fp32
    sum (one K step, not router_logits' three), and the routing is exactly route_topk of them. `logits`
    ([T, E], x's dtype) receives them when given (tests). norm_weight, weight and bias must not be written
    during the step (they are the layer's parameters): under PDL (kernels/pdl.py) they are read before the
    wait, while the kernel before may still run. block_e (experts a program) and num_warps: the launch
    (bench/sweep_glue.py times the alternatives)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    delta = delta if delta.stride(-1) == 1 else delta.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    t, h = x.shape
    e = weight.shape[0]
    if tuple(delta.shape) != (t, h) or t > counters.numel():
        raise ValueError(f"add_rms_norm_route: delta {list(delta.shape)} for x {list(x.shape)}, "
                         f"counters for {counters.numel()} tokens")
    x_new, out = torch.empty_like(x), torch.empty_like(x)
    w = torch.empty(t, k, dtype=torch.bfloat16, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    if t:
        lg = logits if logits is not None else torch.empty(t, e, dtype=x.dtype, device=x.device)
        _add_norm_route_kernel[(t, triton.cdiv(e, block_e))](
            x, delta, norm_weight, x_new, out, weight, bias if bias is not None else weight, lg, counters, w, ids,
            h, e, eps, x.stride(0), delta.stride(0), x_new.stride(0), out.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, TOP_K=k, E_P2=triton.next_power_of_2(e),
            BLOCK=triton.next_power_of_2(max(h, 128)), BLOCK_E=block_e, num_warps=num_warps, **pdl_kwargs(x.device))
    return x_new, out, w, ids
