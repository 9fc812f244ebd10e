"""The opt-in decode fusions' switches (DECODE_FUSIONS, fusion_on), torch-free and importing nothing of
kvrelay: the kernels that read them (kernels/moe_gemv.py, decode_rotary.py) sit below kernels/select.py, which
imports those kernels, so the switches live here, below both; kernels.select re-exports them.
"""

from __future__ import annotations

import os

# Decode-step launch fusions written on 2026-12-04 when no H200 was lent: each removes launches from a batch-1
# decode step and is checked on CPU (and its kernels partly on the H200), but none was timed in the model, so
# each is off until an A/B (bench/h200_steps.sh step envab) shows it faster: flip its default here. The
# variable "1"/"0" overrides the default either way; read at each forward/launch, so a CUDA graph keeps the
# setting it was captured with.
DECODE_FUSIONS: dict[str, bool] = {
    "KVRELAY_DECODE_MERGE_FUSE": False,  # split-KV merge + O projection's FP8 input inside the decode kernel
    "KVRELAY_MOE_NORM_FUSE": False,  # the next block's add + norm inside the MoE's GEMV2 launch
    "KVRELAY_MOE_FUSED_GEMV": False,  # the MoE's two GEMVs in one launch (kernels/moe_fused.py; 2026-12-05)
    "KVRELAY_EMBED_FUSE": False,  # the token lookup inside the first block's norm launch
    "KVRELAY_ROTARY_GATHER": False,  # the rotary rows looked up inside the decode kernel
    "KVRELAY_GRAPH_HEAD_LOGITS": False,  # decode graphs return the head's bf16 logits (no widening launch)
}


def fusion_on(name: str) -> bool:
    """Whether the decode fusion `name` (a key of DECODE_FUSIONS) is on: its variable if set, else its default."""
    value = os.environ.get(name)
    return DECODE_FUSIONS[name] if value is None else value == "1"
