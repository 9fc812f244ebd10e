"""The MoE router at decode sizes in one launch: the router's logits (a GEMV) and the top-k + softmax over
them, which were two launches (kernels.fused.router_logits, then kernels.moe.route_topk), ~4.9 + 1.5 us a
layer at batch 1 on the H200 (bench/results/profile-decode-gpt-oss-20b-b1-8k-graph-*.json).

Each program computes BLOCK_E logits of one token exactly as router_logits does (same tiles, so the same
fp32 sums and one rounding to bf16), writes them, and counts itself in the token's arrival counter; the
program that arrives last reads the token's whole logit row back (from L2) and routes it with
kernels.moe.topk_softmax, the route kernel's own code, then zeroes the counter for the next launch. So the
result equals router_logits + route_topk bit for bit, and replay is deterministic: which program routes
changes nothing it computes. The counters ([ROUTE_MAX_TOKENS] int32, zero between launches) belong to the
caller, allocated before any CUDA-graph capture (engine/layers/moe.py: one per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe import topk_softmax

ROUTE_MAX_TOKENS = 64  # = kernels.fused.ROUTER_GEMV_MAX_TOKENS: above it cuBLAS's GEMM is the better router
_BLOCK_E, _BLOCK_K = 4, 1024  # router_logits' tiles: equal sums need equal tiles


@triton.jit
def _router_route_kernel(x_ptr, w_ptr, b_ptr, logit_ptr, cnt_ptr, w_out, id_out, E, K, s_xt, s_we,
                         HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, E_P2: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # exactly kernels.fused._router_gemv_kernel's loop
        k_ok = k0 + offs_k < K
        xv = tl.load(x_ptr + t.to(tl.int64) * s_xt + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * s_we + k0 + offs_k[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * xv[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    row = logit_ptr + t.to(tl.int64) * E
    tl.store(row + offs_e, acc.to(logit_ptr.dtype.element_ty), mask=e_ok)
    # Every thread's logit store is done before the one release below (the classic last-block pattern:
    # barrier, then a gpu-scope acq_rel atomic); the last arrival's acquire then sees every program's row.
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
            BLOCK_E=_BLOCK_E, BLOCK_K=_BLOCK_K)
    return w, ids
