"""One-off diagnostics: the fixture model on CUDA with each kernel family swapped in, against the CPU path."""
import json
import os
import sys
from pathlib import Path

import torch

from kvrelay.engine.config import load_model_config
from kvrelay.engine.runner import Runner
from kvrelay.engine.weights import open_weights

FIX = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpt-oss-tiny-original"
cfg = load_model_config(FIX)
w = open_weights(FIX, cfg)
runs = json.loads((FIX / "reference.json").read_text())["runs"]
prompt = runs[0]["prompt"] + runs[0]["greedy"][:4]
ref = Runner(cfg, w, page_size=16, kv_tokens=2048).score(prompt)


def hook(r, tag):
    from kvrelay.engine import model as M
    orig = M.Block.__call__

    def call(self, x, *a):
        y = orig(self, x, *a)
        bad = (~torch.isfinite(y)).sum().item()
        if bad:
            print(f"  {tag} layer {self.layer}: {bad} non-finite", flush=True)
        return y
    M.Block.__call__ = call
    return orig


for tag, env in [("torch-on-cuda", {"KVRELAY_KERNELS": "reference"}),
                 ("ref-attn+gpu-moe", {"KVRELAY_ATTENTION": "reference"}),
                 ("triton-attn+gpu-moe", {}),
                 ("triton-attn+gpu-moe decode", {})]:
    os.environ.pop("KVRELAY_KERNELS", None)
    os.environ.pop("KVRELAY_ATTENTION", None)
    os.environ.update(env)
    try:
        r = Runner(cfg, w, device="cuda", page_size=16, kv_tokens=2048, cuda_graphs=False)
        from kvrelay.engine import model as M
        orig = hook(r, tag)
        if "decode" in tag:
            lg = [r.prefill("s", prompt[:10])[None]]
            for t in prompt[10:]:
                lg.append(r.extend("s", [t])[None])
            got = torch.cat(lg)
            want = ref[9:]
        else:
            got, want = r.score(prompt), ref
        M.Block.__call__ = orig
        torch.cuda.synchronize()
        d = (got.cpu() - want).abs()
        print(f"{tag}: max diff {d.max().item():.4f} mean {d.mean().item():.4f} nan {torch.isnan(got).sum().item()} "
              f"top1 agree {(got.cpu().argmax(-1) == want.argmax(-1)).float().mean().item():.2f}", flush=True)
    except Exception as e:
        import traceback
        traceback.print_exc()
        print(f"{tag}: ERROR {e}", flush=True)
# Kernel-level checks at the fixture's shapes
from kvrelay.kernels import moe as kmoe
from kvrelay.kernels.reference import route_topk
g = torch.Generator().manual_seed(0)
lg = torch.randn(50, 8, generator=g).bfloat16().cuda()
wt, ids = kmoe.route_topk(lg, 4)
rw, rid = route_topk(lg, 4)
print("route ids equal", torch.equal(ids, rid), "max id", ids.max().item())
