"""The real `kvrelay serve` on the GPU: a subprocess serving a tiny model with gpt-oss's attention shape
(FlashInfer paths, CUDA graphs) over OpenAI HTTP, checked against the in-process engine on the same GPU.

- One GPU, colocated (configs/h200-1gpu-*.yaml's layout): streams equal the in-process engine's greedy
  tokens (a lone prompt in one chunk runs the very same kernels, so exactly; chunked or batched prompts
  may take another path through bf16 arithmetic, so a divergence is accepted only at a near-tie of the
  reference's top-2 logits); each prompt token is computed once and decode computes only new tokens;
  no page is left.
- Two GPUs when the machine has them: prefill on GPU 0, decode on GPU 1, the KV moved over NIXL between
  the two GPUs' memories: same checks, and decode computed zero prompt tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvrelay.cluster.serve import ready_info

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-attn64"
COMMON = f"""
model: {{name: {MODEL}, dummy: true, seed: 0, quant: bf16, max_context: 4096}}
router: {{host: 127.0.0.1, grpc_port: 0, http_port: 0}}
device: cuda
"""
COLOCATED = COMMON + """
prefill: {workers: 1, max_prompt_tokens: 2048, chunk_tokens: 256}
decode: {workers: 1, max_batch: 16, page_size: 16, cuda_graph_batch_sizes: [1, 2, 4, 8, 16], kv_memory_fraction: 0.1}
gpus: 1
colocate: true
"""
SPLIT = COMMON + """
prefill: {workers: 1, max_prompt_tokens: 2048, chunk_tokens: 256}
decode: {workers: 1, max_batch: 16, page_size: 16, cuda_graph_batch_sizes: [1, 2, 4, 8, 16], kv_memory_fraction: 0.1}
kv_transfer: {ucx_tls: "cuda_ipc,cuda_copy,tcp"}
gpus: 2
"""


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 5) % 1000 + 3 for i in range(n)]


class Server:
    def __init__(self, tmp: Path, config: str):
        cfg = tmp / "serve.yaml"
        cfg.write_text(config)
        self.cfg = cfg
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cluster.cli", "serve", str(cfg)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=tmp)
        self.lines: list[str] = []
        ready = threading.Event()
        self.ready: dict = {}

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                info = ready_info(line)
                if info is not None:
                    self.ready.update(info)
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 900  # a fresh machine JIT-compiles FlashInfer's modules first
        while not ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("kvrelay serve did not become ready:\n" + "".join(self.lines[-60:]))

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        import httpx

        body = {"model": self.ready["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "return_token_ids": True, "ignore_eos": True}
        ids: list[int] = []
        with httpx.stream("POST", f"{self.ready['http']}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        ids += choice.get("token_ids") or []
        return ids

    def status(self) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", "status", str(self.cfg), "--address",
                              self.ready["ray"], "--json", "--timeout", "30"], capture_output=True, text=True,
                             timeout=120, cwd=self.cfg.parent)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def reference():
    from kvrelay.engine.llm import LLM

    llm = LLM(MODEL, dummy=True, seed=0, device="cuda", page_size=16, kv_tokens=16384)
    llm.runner.cuda_graph_batch_sizes = (1, 2, 4, 8, 16)  # as served (graphs are captured on first use)
    return llm


def greedy(ref, prompt: list[int], k: int) -> list[int]:
    from kvrelay.engine.sampling import SamplingParams

    return [o.token_id for o in ref.generate(prompt, SamplingParams(max_tokens=k, temperature=0))]


def near_tie(ref, prompt: list[int], tokens: list[int], step: int) -> bool:
    """Whether the reference's top-2 logits at generated step `step` are within a few bf16 steps."""
    logits = ref.runner.score(prompt + tokens[:step])[-1].float()
    top2 = torch.topk(logits, 2).values
    ulp = 2.0 ** (torch.floor(torch.log2(top2[0].abs().clamp_min(1e-3))) - 7)
    return bool(top2[0] - top2[1] <= 4 * ulp)


def assert_same_or_tie(ref, prompt: list[int], got: list[int], want: list[int], what: str = "") -> None:
    assert len(got) == len(want), what
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is not None:
        assert near_tie(ref, prompt, want, first), f"{what} differs at step {first} without a near-tie: {got} vs {want}"


def check_served(server: Server, reference, *, colocated: bool) -> None:
    # Alone, in one chunk: exactly the in-process engine's tokens.
    lone = [(1, 24), (100, 24), (129, 24), (250, 40)]
    for n, k in lone:
        assert server.complete(prompt_of(n), k) == greedy(reference, prompt_of(n), k), f"prompt {n}"
    # Chunked (700 > 256) and concurrent (queued prompts share forwards, decode batches of up to 16).
    jobs = [(prompt_of(n, i), 8 + (i * 5) % 24) for i, n in enumerate([700, 3, 17, 128, 129, 300, 45, 90] * 2)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: server.complete(*j), jobs))
    for (prompt, k), got in zip(jobs, outs):
        assert_same_or_tie(reference, prompt, got, greedy(reference, prompt, k))
    rows = server.status()
    every = lone + [(len(p), k) for p, k in jobs]
    decode_rows = [r for r in rows if r["role"] in ("decode", "colocated")]
    assert decode_rows and all(r["healthy"] for r in rows), rows
    # Decode computed only the new tokens (the first comes from the prefill); prompts were computed once,
    # by the prefill role, never by decode.
    assert sum(r["decode_tokens"] for r in decode_rows) == sum(k - 1 for _, k in every)
    prompt_tokens = sum(n for n, _ in every)
    if colocated:
        assert decode_rows[0]["prompt_tokens"] == prompt_tokens
    else:
        assert all(r["prompt_tokens"] == 0 for r in decode_rows)
    deadline = time.monotonic() + 20
    while any(any(r["pages_in_use"].values()) or r.get("leases") or r.get("admitted") for r in rows):
        assert time.monotonic() < deadline, f"KV pages still held: {rows}"
        time.sleep(0.5)
        rows = server.status()


def serve_and_check(tmp_path, reference, config: str, *, colocated: bool) -> None:
    server = Server(tmp_path, config)
    try:
        check_served(server, reference, colocated=colocated)
    finally:
        server.stop()
    assert server.proc.returncode == 0, "".join(server.lines[-40:])


def test_serve_colocated_one_gpu(tmp_path, reference):
    serve_and_check(tmp_path, reference, COLOCATED, colocated=True)


def test_serve_split_two_gpus_over_nixl(tmp_path, reference):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nvidia-h200-x2): prefill on one, decode on the other")
    serve_and_check(tmp_path, reference, SPLIT, colocated=False)
