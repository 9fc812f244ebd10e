"""gpt-oss attention: fused QKV with bias, YaRN rotary, GQA over the paged KV cache, per-head sinks,
sliding window on even layers, output projection with bias. Sharded by query heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvrelay.engine import partition
from kvrelay.engine.layers.linear import Linear, Shard, WeightGetter
from kvrelay.engine.partition import HeadRange
from kvrelay.engine.staging import StagingRing, pack
from kvrelay.kernels.reference import apply_rotary, write_kv


def head_range(cfg, shard: Shard) -> HeadRange:
    """The query/KV heads this rank holds. One rule for the layer, the KV cache and the KV handoff plan
    (transfer/sharding.py), which must all agree on which rank holds which KV head. It also rejects
    splits whose ranks would straddle GQA groups unevenly (e.g. 48 query / 6 KV heads on 8 ranks)."""
    return partition.head_range(cfg.num_attention_heads, cfg.num_key_value_heads, shard.rank, shard.world_size)


# (q [T,Hq,D], layer pool, qo_indptr, PagedKV, sinks, sm_scale, window) -> [T,Hq,D]; the reference is
# kernels.reference.paged_attention, a GPU backend swaps in its own with the same signature.
AttentionFn = Callable[..., torch.Tensor]


class Attention:
    def __init__(self, weights: WeightGetter, cfg, layer: int, *, shard: Shard, quant: str, device,
                 dtype: torch.dtype):
        self.layer = layer
        self.heads = h = head_range(cfg, shard)
        self.head_dim = d = cfg.head_dim
        self.window = cfg.sliding_window if cfg.layer_is_sliding(layer) else None
        self.sm_scale = cfg.sm_scale
        self.shard = shard
        p = f"block.{layer}.attn."
        # Q, K and V rows of this rank's heads, fused back into one projection.
        rows = (
            slice(h.q0 * d, h.q1 * d),
            slice(cfg.q_width + h.kv0 * d, cfg.q_width + h.kv1 * d),
            slice(cfg.q_width + cfg.kv_width + h.kv0 * d, cfg.q_width + cfg.kv_width + h.kv1 * d),
        )
        get = lambda name, s: weights.get(p + name, slices=s, dtype=dtype, device=device)  # noqa: E731
        qkv_w = torch.cat([get("qkv.weight", (r,)) for r in rows])
        qkv_b = torch.cat([get("qkv.bias", (r,)) for r in rows])
        self.qkv = Linear(qkv_w, qkv_b, quant)
        # Row-parallel output: each rank multiplies its heads' columns; the bias is added once (rank 0)
        # so the all-reduce sums to the single-process result.
        out_w = get("out.weight", (slice(None), slice(h.q0 * d, h.q1 * d)))
        out_b = get("out.bias", ()) if shard.rank == 0 else None
        self.out = Linear(out_w, out_b, quant)
        self.sinks = weights.get(p + "sinks", slices=(slice(h.q0, h.q1),), dtype=torch.float32, device=device)
        from kvrelay.kernels import select

        self.fused_rotary = select.use_gpu_kernels(device) and torch.device(device).type != "meta"
        self.fused_write = select.fuse_glue(device)  # rotary + the KV-cache write in one launch

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pool: torch.Tensor,
        group: str,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
        attn: "BatchAttention",
    ) -> torch.Tensor:
        """x [T, hidden] (already normed) -> this rank's partial output [T, hidden] (not yet reduced).
        `attn` was planned for this batch once, outside the layers; here it only runs."""
        q = self.project_in(x, cos, sin, pool, write_pages, write_offsets)
        return self.project_out(attn.run(q, pool, group, self.sinks, self.sm_scale, self.window))

    def project_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                   write_pages: torch.Tensor, write_offsets: torch.Tensor) -> torch.Tensor:
        """QKV projection, rotary, and the new K/V rows written to the cache; returns q [T, Hq, D].
        Split from the attention kernel itself so a piecewise CUDA graph can hold everything but the
        attention (whose plan depends on the ragged batch) - engine/cuda_graph.py."""
        return self.rotate_and_write(self.qkv(x), cos, sin, pool, write_pages, write_offsets)

    def project_in_quantized(self, xq: torch.Tensor, sx: torch.Tensor, m: int, dtype: torch.dtype,
                             cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor, write_pages: torch.Tensor,
                             write_offsets: torch.Tensor) -> torch.Tensor:
        """project_in of m rows whose normed input arrives already FP8-quantised for the QKV GEMM
        (kernels.fused.add_rms_norm with quant_k=self.qkv.quant_k)."""
        return self.rotate_and_write(self.qkv.run_quantized(xq, sx, m, dtype), cos, sin, pool, write_pages,
                                     write_offsets)

    def project_in_deferred(self, xq: torch.Tensor, sx: torch.Tensor | None, m: int, dtype: torch.dtype,
                            cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor, write_pages: torch.Tensor,
                            write_offsets: torch.Tensor, positions: torch.Tensor | None = None) -> "RotaryPending":
        """project_in (xq normed, FP8-quantised when sx is given) with the rotary and the KV write left to
        the attention kernel (GpuAttention.run: kernels/decode_rotary.py), or to RotaryPending.apply.
        positions: cos/sin are the whole tables, looked up at these positions by whoever applies them."""
        qkv = self.qkv(xq) if sx is None else self.qkv.run_quantized(xq, sx, m, dtype)
        return RotaryPending(self, qkv, cos, sin, pool, write_pages, write_offsets, positions)

    def rotate_and_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                         write_pages: torch.Tensor, write_offsets: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] (bias included) -> q [T, Hq, D]; rotated K and V written to the cache."""
        h, d = self.heads, self.head_dim
        if self.fused_write:
            from kvrelay.kernels.fused import rotary_kv_write

            return rotary_kv_write(qkv, cos, sin, h.num_q, h.num_kv, d, pool, write_pages, write_offsets)
        q, k, v = qkv.split([h.num_q * d, h.num_kv * d, h.num_kv * d], dim=-1)
        if self.fused_rotary:  # GPU: q and k rotated in one Triton launch (decode steps are launch-bound)
            from kvrelay.kernels.fused import rotary_qk

            q, k = rotary_qk(qkv, cos, sin, h.num_q, h.num_kv, d)
        else:
            q = apply_rotary(q.view(-1, h.num_q, d), cos, sin)
            k = apply_rotary(k.view(-1, h.num_kv, d), cos, sin)
        # The cache holds K after rotary (positions are absolute), so attention never re-rotates.
        write_kv(pool, k, v.view(-1, h.num_kv, d), write_pages, write_offsets)
        return q

    def project_out(self, o) -> torch.Tensor:
        """The attention output [T, Hq, D] through the output projection: [T, hidden] (not reduced).
        `o` may also be a `SinkPending` (GpuAttention.run(defer_sink=True)): the sink correction then
        runs fused with the FP8 GEMM's activation quantisation (kernels.fused.sink_correct_quantize)."""
        if isinstance(o, SinkPending):
            kp = self.out.quant_k
            if kp is None:
                o = o.apply()
            else:
                from kvrelay.kernels.fused import sink_correct_quantize

                xq, sx = sink_correct_quantize(o.out, o.lse, o.sinks, kp)
                return self.out.run_quantized(xq, sx, o.out.shape[0], o.out.dtype)
        from kvrelay.kernels.triton_attention import MergePending

        if isinstance(o, MergePending):
            # a Triton split-KV decode: its merge (with the sink) runs fused with the quantisation
            kp = self.out.quant_k
            if kp is None or o.dtype != torch.bfloat16:
                o = o.apply()
            else:
                xq, sx = o.quantize(kp)
                return self.out.run_quantized(xq, sx, o.batch, o.dtype)
        return self.out(o.reshape(-1, self.heads.num_q * self.head_dim))


@dataclass
class RotaryPending:
    """A layer's QKV projection whose rotary and KV-cache write are still to run (Attention.
    project_in_deferred): a Triton split-KV decode does both inside its kernel (GpuAttention.run); anything
    else calls `apply` first, which is Attention.rotate_and_write (q [T, Hq, D], K/V in the pool)."""

    attn: Attention
    qkv: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    pool: torch.Tensor
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    positions: torch.Tensor | None = None  # set: cos/sin are the whole tables (engine/layers/rotary.py)

    def apply(self) -> torch.Tensor:
        cos, sin = (self.cos, self.sin) if self.positions is None else (self.cos[self.positions],
                                                                         self.sin[self.positions])
        return self.attn.rotate_and_write(self.qkv, cos, sin, self.pool, self.write_pages, self.write_offsets)


@dataclass
class SinkPending:
    """A decode attention output still without its sink (FlashInfer decode): out [B, Hq, D], the log2
    log-sum-exp [B, Hq] and the sinks [Hq]; `apply` corrects out in place (kernels/attention.py)."""

    out: torch.Tensor
    lse: torch.Tensor
    sinks: torch.Tensor

    def apply(self) -> torch.Tensor:
        from kvrelay.kernels.attention import apply_sink_correction

        return apply_sink_correction(self.out, self.lse, self.sinks)


# ---------------------------------------------------------------------------------------------------
# Attention backends: plan once per forward batch, run once per layer
# ---------------------------------------------------------------------------------------------------


class BatchAttention:
    """Attention for one forward batch through an `AttentionFn` (the reference, or any drop-in with its
    signature): `plan(batch)` once per forward, then `run` in every layer."""

    def __init__(self, attention_fn: AttentionFn):
        self.fn = attention_fn
        self.batch = None

    def plan(self, batch) -> None:
        self.batch = batch

    def plan_replay(self, batch, used: dict[str, int]) -> None:
        """A graph-size batch refilled in place (engine/cuda_graph.DecodeGraphBuffers): nothing to plan."""
        self.batch = batch

    def run(self, q, pool, group, sinks, sm_scale, window, defer_sink: bool = False, quant_k: int | None = None):
        """-> the attention output [T, Hq, D]; a backend may answer defer_sink=True with a SinkPending
        (the output projection applies the sink then), this one never does. q may be a RotaryPending.
        quant_k: the FP8 output projection's input width (None: not FP8), which a deferred merge may target."""
        if isinstance(q, RotaryPending):
            q = q.apply()
        return self.fn(q, pool, self.batch.qo_indptr, self.batch.kv[group], sinks, sm_scale, window)

    def fuses_rotary(self, group: str) -> bool:
        """Whether run() takes this group's layers' q as a RotaryPending and does the rotary and KV write in
        its own kernel (GpuAttention's Triton decode); never here."""
        return False


class GpuAttention(BatchAttention):
    """The GPU kernels. backend "flashinfer": FA3 sink prefill for full layers, Triton prefill for
    sliding layers (faster there), and for decode steps, per layer kind, FlashInfer's tensor-core decode
    + fused exact sink correction or the Triton split-KV decode (kernels/select.decode_attention_backend;
    a group decoded by Triton is never planned by FlashInfer); backend "triton": the Triton sink prefill
    and split-KV decode everywhere. Plans (FlashInfer's `plan`, Triton's prefill tiles) read only host
    copies of the batch metadata (`BatchLayout.host`), so they never wait for the device.

    With `graph_batch` set it serves one padded CUDA-graph batch size: decode only, FlashInfer's
    wrappers keep their metadata in fixed buffers (re-planned outside the graph before each replay), and
    the Triton decode launches a split count fixed for that size into a workspace allocated here, once."""

    # Triton decode launch (triton_attention.sink_decode's defaults; the split count is chosen per batch)
    DECODE_BLOCK_N = 64

    def __init__(self, cfg, kv_heads: int, q_heads: int, page_size: int, device, dtype, backend: str, *,
                 workspaces: dict | None = None, graph_batch: int | None = None,
                 graph_max_pages: dict | None = None):
        super().__init__(None)
        from kvrelay.engine.kv_geometry import FULL, SLIDING  # the page groups (one spelling)
        from kvrelay.kernels import select

        self.backend = backend
        self.hq, self.hkv, self.d, self.page = q_heads, kv_heads, cfg.head_dim, page_size
        self.sm_scale = cfg.sm_scale
        self.windows = {FULL: None, SLIDING: cfg.sliding_window}
        self.prefill_kind = {g: select.prefill_attention_backend(backend, w) for g, w in self.windows.items()}
        self.block_q = max(1, 128 // (q_heads // kv_heads))  # triton_attention's default tile
        self.graph_batch = graph_batch
        self.device = torch.device(device)
        self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 8)
        self.decode_splits: dict[str, int] = {}  # Triton-decoded groups: split count of the planned batch
        self._ws: tuple[torch.Tensor, torch.Tensor] | None = None  # their (o_part, lse_part), shared by all layers
        # the decode kernel's merge arrival counters (kernels/decode_rotary.py), one per (sequence, KV head),
        # shared by all layers, zero between launches; grown with _ws, before any graph capture
        self._merge_cnt: torch.Tensor | None = None
        # Decode kernel per group: fixed for a graph size; an eager object decides per planned batch.
        self.decode_kind = self._decode_kinds(graph_batch)
        self.fi = {}
        if backend == "flashinfer":
            from kvrelay.kernels.attention import FlashInferSinkAttention

            # A graph-size object only decodes: it holds FlashInfer only for the groups FlashInfer decodes.
            groups = [g for g in self.windows if graph_batch is None or self.decode_kind[g] == "flashinfer"]
            for g in groups:
                self.fi[g] = FlashInferSinkAttention(
                    q_heads, kv_heads, cfg.head_dim, page_size, self.windows[g], cfg.sm_scale, device, dtype=dtype,
                    workspace=(workspaces or {}).get(g), graph_batch=graph_batch,
                    graph_max_pages=None if graph_max_pages is None else graph_max_pages[g])
        if graph_batch is not None:
            self._triton_decode_setup(graph_batch)
        self.tiles = None
        self._fi_unplanned: set[str] = set()  # prefill groups whose FlashInfer plan waits for their first run
        self._tile_staging = None  # engine/staging.StagingRing of the tile lists, on CUDA (made at first use)

    def _decode_kinds(self, batch: int | None) -> dict[str, str]:
        from kvrelay.kernels import select

        return {g: select.decode_attention_backend(self.backend, w, batch) for g, w in self.windows.items()}

    def _triton_decode_setup(self, batch: int) -> None:
        """Split counts of the Triton-decoded groups at `batch` sequences, and a workspace big enough for
        them (grown, never shrunk: an eager object sees many batch sizes; a graph's is sized once)."""
        from kvrelay.kernels import triton_attention as ta

        self.decode_splits = {g: ta.default_num_splits(batch, self.hkv, num_sms=self._num_sms,
                                                       block_n=self.DECODE_BLOCK_N, window=self.windows[g])
                              for g, kind in self.decode_kind.items() if kind == "triton"}
        if not self.decode_splits:
            return
        need = batch * self.hq * max(self.decode_splits.values())
        if self._ws is None or self._ws[1].numel() < need:
            self._ws = ta.decode_workspace(batch, self.hq, self.d, max(self.decode_splits.values()), self.device)
        if self._merge_cnt is None or self._merge_cnt.numel() < batch * self.hkv:
            self._merge_cnt = torch.zeros(batch * self.hkv, dtype=torch.int32, device=self.device)

    def plan(self, batch) -> None:
        self.batch = batch
        host = batch.host
        if batch.is_decode:
            if self.graph_batch is None:
                self.decode_kind = self._decode_kinds(batch.num_seqs)
                self._triton_decode_setup(batch.num_seqs)
            for g, fi in self.fi.items():
                if self.decode_kind[g] == "flashinfer":
                    fi.plan_decode(host["kv_indptr"][g], batch.kv[g].kv_indices, host["kv_last_page_len"][g])
            return
        if self.graph_batch is not None:
            raise RuntimeError("a CUDA-graph attention serves decode steps only")
        # FlashInfer's prefill plan (~2 ms of host work at 8k tokens) is made at the group's first run
        # instead: layer 0 is a sliding layer on the Triton kernel, so the GPU starts on it while the host
        # plans for the first full layer (it used to sit idle through the plan before the first kernel).
        self._fi_unplanned = {g for g, kind in self.prefill_kind.items() if kind == "flashinfer"}
        if "triton" in self.prefill_kind.values():
            from kvrelay.kernels.triton_attention import prefill_tiles

            seq, q0 = prefill_tiles(host["qo_indptr"].numpy(), self.block_q)
            if batch.qo_indptr.is_cuda:
                # a ring of its own, one slot per plan (each plan is one forward's), instead of pinning
                # fresh memory per plan
                if self._tile_staging is None:
                    self._tile_staging = StagingRing(batch.qo_indptr.device)
                self._tile_staging.next()
                dev, _ = pack([(0, seq, torch.int32), (1, q0, torch.int32)], batch.qo_indptr.device,
                              self._tile_staging)
                self.tiles = (dev[0], dev[1])
            else:
                t = torch.from_numpy(np.stack([seq, q0]).astype(np.int32))
                self.tiles = (t[0], t[1])

    def fuses_rotary(self, group: str) -> bool:
        """A decode batch of this group on the Triton split kernel: its layers' rotary and KV write then run
        inside that kernel (kernels/decode_rotary.py; one launch fewer a layer: H200 batch-1 decode at 8k
        1.90 -> 1.86 ms 20b, 2.72 -> 2.67 ms 120b, bench/results/ab). KVRELAY_DECODE_ROTARY=0 turns it off
        (A/B runs; read at each forward, so a CUDA graph keeps the setting it was captured with)."""
        import os

        return (os.environ.get("KVRELAY_DECODE_ROTARY") != "0" and self.batch is not None
                and self.batch.is_decode and self.decode_kind[group] != "flashinfer")

    def _merge_here(self, quant_k: int | None) -> bool:
        """A deferred Triton decode merges inside its kernel (kernels/decode_rotary.py): the output projection
        takes the heads' full width in FP8 and KVRELAY_DECODE_MERGE_FUSE=1 (decode_rotary.merge_fuse_enabled)."""
        from kvrelay.kernels.decode_rotary import merge_fuse_enabled

        return quant_k == self.hq * self.d and merge_fuse_enabled()

    def plan_replay(self, batch, used: dict[str, int]) -> None:
        """The replay hook of a CUDA-graph decode batch (engine/cuda_graph.DecodeGraphBuffers.prepare):
        `batch` is the graph's BatchLayout of fixed buffers, just refilled, with `used[g]` page indices
        per group. FlashInfer plans into its wrappers' fixed buffers from the device copy of the indices
        (it copies device-to-device); the Triton kernels read the buffers as they are."""
        self.batch = batch
        for g, fi in self.fi.items():
            if self.decode_kind[g] == "flashinfer":
                fi.plan_decode(batch.host["kv_indptr"][g], batch.kv[g].kv_indices[: used[g]],
                               batch.host["kv_last_page_len"][g])

    def run(self, q, pool, group, sinks, sm_scale, window, defer_sink: bool = False, quant_k: int | None = None):
        """-> [T, Hq, D]; a decode asked for defer_sink returns a SinkPending (FlashInfer) or a MergePending
        (Triton split-KV: its merge, which applies the sink, is left to the output projection) instead; the
        rotary-fused Triton decode merges inside its kernel when quant_k is the heads' width (a MergedQuant
        holding the FP8 output projection's input, kernels/decode_rotary.py)."""
        from kvrelay.kernels import triton_attention as ta

        kv = self.batch.kv[group]
        if isinstance(q, RotaryPending):
            if self.batch.is_decode and self.decode_kind[group] != "flashinfer":
                from kvrelay.kernels.decode_rotary import sink_decode_rotary

                h = q.attn.heads
                return sink_decode_rotary(q.qkv, q.cos, q.sin, h.num_q, h.num_kv, pool, q.write_pages,
                                          q.write_offsets, sinks, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len,
                                          sm_scale=sm_scale, window=window, num_splits=self.decode_splits[group],
                                          block_n=self.DECODE_BLOCK_N, workspace=self._ws, merge=not defer_sink,
                                          merge_counters=self._merge_cnt if self._merge_here(quant_k) else None,
                                          positions=q.positions)
            q = q.apply()
        if self.batch.is_decode:
            if self.decode_kind[group] == "flashinfer":
                if defer_sink:
                    return SinkPending(*self.fi[group].decode_nosink(q, pool), sinks)
                return self.fi[group].decode(q, pool, sinks)
            return ta.sink_decode(q, pool, sinks, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len,
                                  sm_scale=sm_scale, window=window, num_splits=self.decode_splits[group],
                                  block_n=self.DECODE_BLOCK_N, workspace=self._ws, merge=not defer_sink)
        if self.prefill_kind[group] == "flashinfer":
            if group in self._fi_unplanned:
                host = self.batch.host
                self.fi[group].plan_prefill(host["qo_indptr"], host["kv_indptr"][group], kv.kv_indices,
                                            host["kv_last_page_len"][group])
                self._fi_unplanned.discard(group)
            return self.fi[group].prefill(q, pool, sinks)
        return ta.sink_prefill(q, pool, sinks, self.batch.qo_indptr, kv.kv_indptr, kv.kv_indices,
                               kv.kv_last_page_len, sm_scale=sm_scale, window=window, tiles=self.tiles,
                               block_q=self.block_q)
