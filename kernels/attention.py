"""FlashInfer sink attention for Hopper: the fast GPU backend.

What h200-notes established (FlashInfer 0.7.2.post1 on the H200), and what this file therefore does:
- prefill: `BatchAttentionWithAttentionSinkWrapper` with backend="fa3" applies the sink and the window
  edge correctly (≈418 TFLOP/s at 8192 tokens). The plain prefill wrapper's `sinks=` is 5x less accurate
  on windowed layers, so it is not used.
- decode: `BatchDecodeWithPagedKVCacheWrapper.run(..., sinks=)` IGNORES the sink on Hopper. We run the
  tensor-core decode without a sink, ask for the log-sum-exp, and apply the exact identity
      out_sink = out * sigmoid(lse_ln - S_h),   lse_ln = lse_log2 * ln 2
  (softmax with one extra logit S_h whose mass is dropped). The correction is one fused Triton launch
  (a chain of torch ops costs four launches, a visible share of a 0.3 ms decode).
- window: FlashInfer's window_left counts keys to the left of the query, so window_left = window - 1.

One `FlashInferSinkAttention` serves every layer of one kind (full or sliding): plan once per batch,
run once per layer. Plans read host metadata; with `graph_batch` set, the decode wrapper keeps its
metadata in fixed buffers so `decode` can be captured in a CUDA graph and re-planned outside it.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .pdl import enter, pdl_kwargs

LN2 = math.log(2.0)
_WORKSPACE_BYTES = 128 << 20


@triton.jit
def _sink_correction_kernel(out, lse, sinks, n_rows, n_heads, s_ob, s_oh, HEAD_DIM: tl.constexpr,
                            ROWS: tl.constexpr, USE_PDL: tl.constexpr = False):
    # out[b, h, :] *= sigmoid(lse[b, h] * ln2 - sink[h]); ROWS (b, h) rows per program.
    enter(USE_PDL)  # kernels/pdl.py: before any load (out and lse are FlashInfer's, just written) or store
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < n_rows
    b = r // n_heads
    h = r % n_heads
    l2 = tl.load(lse + r, mask=ok, other=0.0)
    s = tl.load(sinks + h, mask=ok, other=0.0).to(tl.float32)
    f = 1.0 / (1.0 + tl.exp(s - l2 * 0.6931471805599453))
    d = tl.arange(0, HEAD_DIM)
    ptr = out + b.to(tl.int64)[:, None] * s_ob + h[:, None] * s_oh + d[None, :]
    o = tl.load(ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(ptr, (o * f[:, None]).to(out.dtype.element_ty), mask=ok[:, None])


def apply_sink_correction(out: torch.Tensor, lse_log2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """In place: attention-without-sink output [B, H, D] -> attention-with-sink output."""
    n_rows = out.shape[0] * out.shape[1]
    if n_rows == 0:
        return out
    rows = 16
    _sink_correction_kernel[(triton.cdiv(n_rows, rows),)](
        out, lse_log2.contiguous(), sinks, n_rows, out.shape[1], out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2], ROWS=rows, num_warps=2, **pdl_kwargs(out.device))
    return out


def apply_sink_correction_torch(out: torch.Tensor, lse_log2: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The same identity as separate torch ops (kept for the benchmark's comparison)."""
    f = torch.sigmoid(lse_log2 * LN2 - sinks.float()[None, :])
    out.mul_(f.unsqueeze(-1).to(out.dtype))
    return out


class FlashInferSinkAttention:
    """Sink attention for one layer kind (window None = full, else sliding) over the paged NHD pool."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 window: int | None, sm_scale: float, device, *, dtype=torch.bfloat16,
                 workspace: torch.Tensor | None = None, prefill_backend: str = "fa3",
                 graph_batch: int | None = None, graph_max_pages: int | None = None):
        import flashinfer  # imported here: CPU machines never load it

        self.hq, self.hkv, self.d, self.page = num_qo_heads, num_kv_heads, head_dim, page_size
        self.window_left = -1 if not window else int(window) - 1
        self.sm_scale = float(sm_scale)
        self.dtype = dtype
        self.device = torch.device(device)
        self.workspace = workspace if workspace is not None else torch.zeros(
            _WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchAttentionWithAttentionSinkWrapper(
            self.workspace, "NHD", backend=prefill_backend, q_data_type=dtype, kv_data_type=dtype,
            head_dim_qk=head_dim, head_dim_vo=head_dim, window_left=self.window_left)
        self.graph_batch = graph_batch
        if graph_batch is not None:
            i32 = dict(dtype=torch.int32, device=self.device)
            self._dec_indptr = torch.zeros(graph_batch + 1, **i32)
            self._dec_indices = torch.zeros(graph_max_pages, **i32)
            self._dec_last = torch.zeros(graph_batch, **i32)
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self._dec_indptr, paged_kv_indices_buffer=self._dec_indices,
                paged_kv_last_page_len_buffer=self._dec_last)
            self._dec_out = torch.empty(graph_batch, num_qo_heads, head_dim, dtype=dtype, device=self.device)
            self._dec_lse = torch.empty(graph_batch, num_qo_heads, dtype=torch.float32, device=self.device)
        else:
            self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=True)
        self._sinks_f32: dict[int, torch.Tensor] = {}
        self._no_split = self.window_left >= 0 and os.environ.get("KVRELAY_FI_SLIDING_SPLIT") != "1"

    def _sinks(self, sinks: torch.Tensor) -> torch.Tensor:
        # The FA3 sink variant reads float32 sinks; convert each layer's tensor once.
        if sinks.dtype == torch.float32:
            return sinks
        key = sinks.data_ptr()
        cached = self._sinks_f32.get(key)
        if cached is None or cached.shape != sinks.shape:
            cached = self._sinks_f32[key] = sinks.float()
        return cached

    # -- prefill ------------------------------------------------------------------------------------
    def plan_prefill(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len) -> None:
        self._prefill.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, self.hq, self.hkv, self.d,
                           self.page, causal=True, window_left=self.window_left, sm_scale=self.sm_scale,
                           q_data_type=self.dtype, kv_data_type=self.dtype)

    def prefill(self, q: torch.Tensor, pool: torch.Tensor, sinks: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        # The JIT variant declares (sink tensor, sm_scale scalar) as extra run() arguments, in order.
        return self._prefill.run(q, pool, self._sinks(sinks), self.sm_scale, out=out)

    # -- decode -------------------------------------------------------------------------------------
    def plan_decode(self, kv_indptr, kv_indices, kv_last_page_len) -> None:
        # A sliding layer reads at most one window (128 keys, 9 pages) per sequence: splitting that over
        # CTAs buys no parallelism worth its merge kernel (3 us a layer at batch 1 on the H200, beside an
        # 8.5 us attention kernel; bench/results/profile-decode-*-b1-8k-graph-*.json), so its plan does
        # not split (merge 75 -> 39 us a 20b step at batch 1, 8k). KVRELAY_FI_SLIDING_SPLIT=1 restores
        # FlashInfer's own choice (A/B). Full layers keep the planner's split: pinning it at 16 or 64 pages
        # a CTA made their attention 6.5x slower (142 -> 922 us a step; both measured on the H200 at 2690a31).
        self._decode.plan(kv_indptr, kv_indices, kv_last_page_len, self.hq, self.hkv, self.d, self.page,
                          window_left=self.window_left, sm_scale=self.sm_scale, q_data_type=self.dtype,
                          kv_data_type=self.dtype, disable_split_kv=self._no_split)

    def decode_nosink(self, q: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph_batch is not None:
            return self._decode.run(q, pool, out=self._dec_out, lse=self._dec_lse, return_lse=True)
        return self._decode.run(q, pool, return_lse=True)

    def decode(self, q: torch.Tensor, pool: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] -> [B, Hq, D] with the sink applied exactly (see module docstring)."""
        out, lse = self.decode_nosink(q, pool)
        return apply_sink_correction(out, lse, sinks)


def paged_attention(q, pool, qo_indptr, kv, sinks, sm_scale, window):
    """Drop-in for kernels.reference.paged_attention (plans on every call: for tests and tools; the
    engine keeps one FlashInferSinkAttention per layer kind and plans once per batch)."""
    att = _cached_attention(q.shape[1], pool.shape[3], q.shape[2], pool.shape[2], window, sm_scale, q.device,
                            q.dtype)
    att.plan_prefill(qo_indptr, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len)
    return att.prefill(q, pool, sinks)


_CACHE: dict[tuple, FlashInferSinkAttention] = {}


def _cached_attention(hq, hkv, d, page, window, sm_scale, device, dtype) -> FlashInferSinkAttention:
    key = (hq, hkv, d, page, window, float(sm_scale), str(device), dtype)
    if key not in _CACHE:
        _CACHE[key] = FlashInferSinkAttention(hq, hkv, d, page, window, sm_scale, device, dtype=dtype)
    return _CACHE[key]
