"""gpt-oss mixture of experts: router with bias, top-k then softmax over the k (bf16), experts with
biases and the clamped SwiGLU on interleaved gate/up rows. Sharded by experts (each rank holds a
contiguous range; the inputs are replicated and one all-reduce combines)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrelay.engine.layers.linear import ExpertLinears, Linear, Shard, WeightGetter
from kvrelay.engine.mxfp4 import quantize_mxfp4
from kvrelay.kernels import select
from kvrelay.kernels.reference import clamped_swiglu, route_topk

if TYPE_CHECKING:  # imported where used (the GPU path): kernels.moe_gemv imports triton
    from kvrelay.kernels.moe_gemv import MoePending


class MoE:
    def __init__(self, weights: WeightGetter, cfg, layer: int, *, shard: Shard, quant: str, device,
                 dtype: torch.dtype):
        p = f"block.{layer}.mlp."
        self.top_k = cfg.experts_per_token
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        # The router is tiny and decides which experts run: it stays bf16 and replicated.
        self.router = Linear(weights.get(p + "gate.weight", dtype=dtype, device=device),
                             weights.get(p + "gate.bias", dtype=dtype, device=device))
        self.fused_router = select.fuse_glue(device)
        n_experts = self.num_experts = cfg.num_experts
        if getattr(shard, "expert_parallel", True):
            self.e0, self.e1 = shard.span(n_experts, "num_experts")
            rows1 = cols2 = slice(None)
            keep_bias2 = True
        else:
            # Every rank holds every expert but only intermediate units [i0, i1). Gate/up rows are
            # interleaved per unit, so that is the contiguous row block [2*i0, 2*i1) of mlp1, and the
            # activation is elementwise per unit; mlp2's output bias is added on rank 0 only, so the
            # all-reduce sums to gate * (W2 act + b2) exactly as unsharded.
            self.e0, self.e1 = 0, n_experts
            i0, i1 = shard.span(cfg.intermediate_size, "intermediate_size")
            rows1, cols2 = slice(2 * i0, 2 * i1), slice(i0, i1)
            keep_bias2 = shard.rank == 0
        experts = slice(self.e0, self.e1)
        get = lambda name, s: weights.get(p + name, slices=s, dtype=dtype, device=device)  # noqa: E731
        bias2 = get("mlp2_bias", (experts,))
        bias2 = bias2 if keep_bias2 else torch.zeros_like(bias2)
        # GPU: stacked experts for the Triton kernels (routing, decode GEMV, grouped GEMM; FP8 with
        # 128x128 block scales). CPU: one reference Linear per expert.
        self.gpu = None
        if quant == "mxfp4":
            b1, s1, b2, s2 = _mxfp4_experts(weights, p, experts, rows1, cols2, device)
            bias1 = get("mlp1_bias", (experts, rows1))
            if select.use_gpu_kernels(device) and torch.device(device).type != "meta":
                from kvrelay.kernels.moe import MoEWeights

                self.gpu = MoEWeights.from_mxfp4(b1, s1, bias1, b2, s2, bias2)
                if self.fused_router:
                    from kvrelay.kernels import router as kroute

                    self._route_counters = kroute.new_counters(device)
                return
            self.mlp1 = ExpertLinears((b1, s1), bias1, quant)
            self.mlp2 = ExpertLinears((b2, s2), bias2, quant)
            return
        if select.use_gpu_kernels(device) and torch.device(device).type != "meta":
            if quant == "bf16":
                self.gpu = _gpu_experts(get("mlp1_weight", (experts, rows1)), get("mlp1_bias", (experts, rows1)),
                                        get("mlp2_weight", (experts, slice(None), cols2)), bias2, quant)
            else:
                self.gpu = _gpu_experts_fp8_chunked(get, self.e0, self.e1, rows1, cols2,
                                                    get("mlp1_bias", (experts, rows1)), bias2)
            if self.fused_router:
                from kvrelay.kernels import moe_fused, moe_gemv, router as kroute

                # the fused router's, the norm-fused GEMV2's and the fused GEMVs' (routed_uncombined) counters:
                # allocated here, before any CUDA-graph capture; each launch leaves its counters zero
                self._route_counters = kroute.new_counters(device)
                self._norm_counters = moe_gemv.new_norm_counters(device)
                self._fused_counters = moe_fused.new_fused_counters(device)
            return
        self.mlp1 = ExpertLinears(get("mlp1_weight", (experts, rows1)), get("mlp1_bias", (experts, rows1)), quant)
        self.mlp2 = ExpertLinears(get("mlp2_weight", (experts, slice(None), cols2)), bias2, quant)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (already normed) -> this rank's partial output (its experts' share)."""
        if self.gpu is not None:
            return self._gpu_forward(x).to(x.dtype)
        gate, experts = route_topk(self.router(x), self.top_k)
        out = torch.zeros_like(x)
        local = experts - self.e0
        mine = (local >= 0) & (local < self.e1 - self.e0)
        for e in torch.unique(local[mine]).tolist():
            tokens, slot = torch.where(local == e)
            y = self.mlp2(e, clamped_swiglu(self.mlp1(e, x[tokens]), self.alpha, self.limit))
            # The expert's output bias is inside y, so it is weighted too (as in every reference). A token
            # picks an expert at most once, so the rows are distinct and a plain indexed add is exact
            # (and much faster on CPU than index_add_ in bf16).
            out[tokens] += y * gate[tokens, slot, None]
        return out

    def uncombined(self, x: torch.Tensor) -> torch.Tensor:
        """GPU only: the weighted expert outputs [T, k, hidden] before their sum (in the model's dtype: bf16
        pairs from either kernel path of a bf16 model); kernels.fused.add_rms_norm sums them in fp32 (as
        kernels.moe's combine does) inside the next residual add."""
        return self._gpu_forward(x, combine=False)

    def fused_route_in(self, x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """The block's residual add + MoE norm + router in one launch where it applies (GPU, fused glue,
        decode sizes): (x + delta, normed, gate, experts) for `routed_uncombined`; None otherwise."""
        from kvrelay.kernels import router as kroute

        if self.gpu is None or not self.fused_router or x.shape[0] > kroute.ROUTE_MAX_TOKENS or delta.dim() != 2:
            return None
        return kroute.add_rms_norm_route(x, delta, norm_weight, eps, self.router.weight, self.router.bias,
                                         self.top_k, self._route_counters)

    def routed_uncombined(self, x: torch.Tensor, gate: torch.Tensor,
                          experts: torch.Tensor) -> torch.Tensor | MoePending:
        """`uncombined` with the routing already done (fused_route_in), or at the smallest decode batches (with
        KVRELAY_MOE_NORM_FUSE=1, kernels.moe_gemv.norm_fuse) a kernels.moe_gemv.MoePending: the experts' second
        GEMV left to the consumer, which fuses the next residual add + RMSNorm into it (engine/model.py's
        Block.residual_attention_in) or launches it alone. With KVRELAY_MOE_FUSED_GEMV=1
        (kernels.moe_gemv.fused_gemv) the experts' two GEMVs run in one launch (kernels/moe_fused.py)."""
        from kvrelay.kernels.moe_gemv import fused_gemv, norm_fuse

        counters = self._norm_counters if norm_fuse() else None
        fused = self._fused_counters if fused_gemv() else None
        return self._experts(x, gate, experts, combine=False, norm_counters=counters, fused_counters=fused)

    def _gpu_forward(self, x: torch.Tensor, combine: bool = True) -> torch.Tensor:
        """Routing and experts on the GPU kernels: no host sync, so a decode step can be graph-captured."""
        from kvrelay.kernels import moe as kmoe, router as kroute

        if self.fused_router and x.shape[0] <= kroute.ROUTE_MAX_TOKENS:
            # logits + top-k + softmax in one launch (cuBLAS's split-K GEMM + reduce + route were three)
            gate, experts = kroute.router_route(x, self.router.weight, self.router.bias, self.top_k,
                                                self._route_counters)
        else:
            gate, experts = kmoe.route_topk(self.router(x), self.top_k)
        return self._experts(x, gate, experts, combine)

    def _experts(self, x: torch.Tensor, gate: torch.Tensor, experts: torch.Tensor, combine: bool,
                 norm_counters: torch.Tensor | None = None,
                 fused_counters: torch.Tensor | None = None) -> torch.Tensor | MoePending:
        from kvrelay.kernels import moe as kmoe

        n_local = self.e1 - self.e0
        if n_local < self.num_experts:
            # Expert parallel: pairs routed to another rank's experts get weight 0 (and a valid local
            # id), so they add nothing; the all-reduce over ranks sums each pair exactly once.
            local = experts - self.e0
            mine = (local >= 0) & (local < n_local)
            experts = torch.where(mine, local, torch.zeros_like(local))
            gate = torch.where(mine, gate, torch.zeros_like(gate))
        return kmoe.moe_experts(x, experts, gate, self.gpu, alpha=self.alpha, limit=self.limit, combine=combine,
                                norm_counters=norm_counters, fused_counters=fused_counters)


def _mxfp4_experts(weights: WeightGetter, p: str, experts: slice, rows1: slice, cols2: slice, device):
    """(blocks1, scales1, blocks2, scales2) of this rank's experts in MXFP4 as the checkpoint stores them
    (engine/weights.WeightSource.get_mxfp4), on `device`. A checkpoint without MXFP4 experts (bf16, converted
    FP8, a test's tensors) has them quantised here, round to nearest, a few experts at a time."""
    out = []
    for name, region in (("mlp1_weight", (experts, rows1)), ("mlp2_weight", (experts, slice(None), cols2))):
        got = weights.get_mxfp4(p + name, region, device=device) if hasattr(weights, "get_mxfp4") else None
        if got is None:
            first, end = experts.indices(1 << 30)[:2]
            parts = [quantize_mxfp4(weights.get(p + name, slices=(slice(e, min(e + 8, end)), *region[1:]),
                                                dtype=torch.float32, device=device)) for e in range(first, end, 8)]
            got = (torch.cat([b for b, _ in parts]), torch.cat([s for _, s in parts]))
        out.extend(got)
    return tuple(out)


def _gpu_experts(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, quant: str):
    from kvrelay.kernels.moe import MoEWeights

    if quant == "bf16":
        return MoEWeights.from_bf16(w1, b1, w2, b2)
    from kvrelay.kernels.fp8 import quantize_experts_block128

    q1, s1 = quantize_experts_block128(w1)
    del w1
    q2, s2 = quantize_experts_block128(w2)
    return MoEWeights.from_fp8(q1, s1, b1, q2, s2, b2)


def _gpu_experts_fp8_chunked(get, e0: int, e1: int, rows1: slice, cols2: slice, b1: torch.Tensor,
                             b2: torch.Tensor, chunk: int = 8):
    """FP8 experts quantised a few experts at a time straight into K-padded buffers. Loading the whole
    layer in bf16 first (4.2 GB for one 120b mlp1) and then padding copies left ~30 GB of fragments in
    the caching allocator and ran a 120b model out of memory on a 141 GB card."""
    from kvrelay.kernels.fp8 import BLOCK, quantize_experts_block128
    from kvrelay.kernels.moe import MoEWeights

    def quantise(name: str, extra: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        q = sc = None
        for c0 in range(e0, e1, chunk):
            w = get(name, (slice(c0, min(c0 + chunk, e1)), *extra))
            qc, sc_c = quantize_experts_block128(w)
            if q is None:
                n, k = w.shape[1], w.shape[2]
                kp = -(-k // BLOCK) * BLOCK
                q = torch.zeros((e1 - e0, n, kp), dtype=qc.dtype, device=w.device)
                sc = torch.ones((e1 - e0, -(-n // BLOCK), kp // BLOCK), dtype=torch.float32, device=w.device)
            q[c0 - e0:c0 - e0 + w.shape[0], :, :k] = qc
            sc[c0 - e0:c0 - e0 + w.shape[0]] = sc_c
            del w, qc, sc_c
        return q, sc

    q1, s1 = quantise("mlp1_weight", (rows1,))
    q2, s2 = quantise("mlp2_weight", (slice(None), cols2))
    hidden, inter = q2.shape[1], b1.shape[1] // 2
    return MoEWeights(q1, b1.contiguous(), q2, b2.contiguous(), s1, s2, hidden, inter)
