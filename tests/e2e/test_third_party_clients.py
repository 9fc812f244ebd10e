"""Third-party clients against `kvrelay serve configs/cpu-tiny.yaml`, as users run them, offline:

- lm-eval (`lm_eval --model local-completions`, its tokenizer our own /tokenize via
  tokenizer_backend=remote) on two local tasks written here: a multiple-choice loglikelihood task (echo +
  logprobs 1, the prompt logprobs computed by the prefill worker), whose every choice's loglikelihood,
  is_greedy and the task's accuracy must equal a float64 reference from Runner.score on the same model; and
  a generate_until task, whose outputs must equal the same requests sent to the server directly.
- aiperf: a short streaming completions profile (its tiktoken-backed `builtin` tokenizer, the vocabulary
  shipped with kvrelay, engine/o200k-vocab/): every request must succeed and stream the tokens it asked for.

The clients live in their own venv (.venv-clients, `make clients-venv`, pins in clients/requirements.txt):
their pins are not ours.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvrelay.engine import vocab
from serve_proc import serving_cli

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"

MC_DOCS = [
    {"question": "Question: What is the capital of France?\nAnswer:", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Question: 2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "Question: Which one is a color?\nAnswer:", "choices": ["blue", "seven", "quickly", "dog"], "answer": 0},
    {"question": "Question: The sun rises in the", "choices": ["east", "west"], "answer": 0},
]
GEN_DOCS = [{"prompt": "Once upon a time", "target": "there"}, {"prompt": "The quick brown fox", "target": "jumps"},
            {"prompt": "1, 2, 3,", "target": "4"}]


def clients_venv() -> Path:
    venv = Path(os.environ.get("KVRELAY_CLIENTS_VENV", REPO / ".venv-clients"))
    if not (venv / ".installed").exists():  # what `make test` builds first; here for a direct pytest run
        subprocess.run(["make", "-s", "clients-venv", f"CLIENTS_VENV={venv}"], cwd=REPO, check=True, timeout=1200)
    return venv


@pytest.fixture(scope="module")
def served():
    """`kvrelay serve configs/cpu-tiny.yaml` on free 127.0.0.1 ports: the ready line's endpoints."""
    with serving_cli(str(REPO / "configs" / "cpu-tiny.yaml"), "--http-port", "0", "--grpc-port", "0",
                     term_timeout_s=60) as s:
        assert s.ready["http"].startswith("http://127.0.0.1:")
        yield s.ready


@pytest.fixture(scope="module")
def reference():
    from kvrelay.engine.llm import LLM

    return LLM("gpt-oss-tiny", dummy=True, seed=0, page_size=16, kv_tokens=4096)


def _offline_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "HF_TOKEN"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf"),
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", PYTHONUNBUFFERED="1")
    return env


def _write_tasks(tmp: Path) -> Path:
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "kvrelay_mc.yaml").write_text(f"""task: kvrelay_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tasks / "kvrelay_gen.yaml").write_text(f"""task: kvrelay_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return tasks


def _reference_choice(reference, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's loglikelihood of `continuation` after `context` (its token split: the continuation's
    tokens are those the whole text has past the context's), in float64 from Runner.score."""
    import torch

    from kvrelay.router import harmony

    ctx = harmony.encode_text(context)
    whole = harmony.encode_text(context + continuation)
    assert whole[: len(ctx)] == ctx
    lp = torch.log_softmax(reference.runner.score(whole).double(), dim=-1)
    rows = range(len(ctx) - 1, len(whole) - 1)
    ll = sum(float(lp[i, whole[i + 1]]) for i in rows)
    greedy = all(int(torch.argmax(lp[i])) == whole[i + 1] for i in rows)
    return ll, greedy


def _samples(out: Path, task: str) -> list[dict]:
    files = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    return [json.loads(ln) for ln in Path(files[0]).read_text().splitlines() if ln.strip()]


def test_lm_eval_loglikelihood_and_generate_until(served, reference, tmp_path):
    from kvrelay.router import harmony

    lm_eval = clients_venv() / "bin" / "lm_eval"
    tasks, out = _write_tasks(tmp_path), tmp_path / "out"
    args = (f"model={served['model']},base_url={served['http']}/v1/completions,tokenizer_backend=remote,"
            "tokenized_requests=True,num_concurrent=2,max_retries=1,timeout=120")
    t0 = time.monotonic()
    res = subprocess.run([str(lm_eval), "--model", "local-completions", "--model_args", args,
                          "--tasks", "kvrelay_mc,kvrelay_gen", "--include_path", str(tasks), "--batch_size", "4",
                          "--output_path", str(out), "--log_samples"],
                         env=_offline_env(tmp_path), capture_output=True, text=True, timeout=420)
    print(f"\nlm_eval ran {time.monotonic() - t0:.1f} s")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    results = json.loads(Path(glob.glob(str(out / "**" / "results_*.json"), recursive=True)[0]).read_text())

    samples = sorted(_samples(out, "kvrelay_mc"), key=lambda s: s["doc_id"])
    assert len(samples) == len(MC_DOCS)
    correct = 0
    for s, doc in zip(samples, MC_DOCS):
        got = [(float(ll), str(g) == "True") for ll, g in s["filtered_resps"]]
        want = [_reference_choice(reference, doc["question"], " " + c) for c in doc["choices"]]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=2e-2), doc
        assert [g for _, g in got] == [g for _, g in want], doc
        correct += max(range(len(want)), key=lambda i: want[i][0]) == doc["answer"]
    assert results["results"]["kvrelay_mc"]["acc,none"] == pytest.approx(correct / len(MC_DOCS))

    gens = sorted(_samples(out, "kvrelay_gen"), key=lambda s: s["doc_id"])
    assert len(gens) == len(GEN_DOCS)
    for s, doc in zip(gens, GEN_DOCS):
        direct = httpx.post(f"{served['http']}/v1/completions", timeout=120, json={
            "model": served["model"], "prompt": harmony.encode_text(doc["prompt"]), "max_tokens": 8,
            "temperature": 0, "stop": ["\n\n"]}).json()["choices"][0]["text"]
        assert s["resps"][0][0] == direct, doc
    assert "exact_match,none" in results["results"]["kvrelay_gen"]


def test_aiperf_streaming_profile_without_failures(served, tmp_path):
    aiperf = clients_venv() / "bin" / "aiperf"
    cache = tmp_path / "tiktoken"
    cache.mkdir()
    # tiktoken's disk cache keys the vocabulary by sha1(url): kvrelay's packaged copy, no download.
    shutil.copy(vocab.vocab_file(), cache / hashlib.sha1(O200K_URL.encode()).hexdigest())
    env = dict(_offline_env(tmp_path), TIKTOKEN_CACHE_DIR=str(cache))
    art = tmp_path / "aiperf"
    requests, osl = 12, 16
    t0 = time.monotonic()
    res = subprocess.run([str(aiperf), "profile", "--model", served["model"], "--url", served["http"],
                          "--endpoint-type", "completions", "--streaming", "--tokenizer", "builtin",
                          "--request-count", str(requests), "--concurrency", "3", "--isl", "32", "--osl", str(osl),
                          "--extra-inputs", "ignore_eos:true", "--random-seed", "0", "--workers-max", "2",
                          "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
                          "--artifact-dir", str(art)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    print(f"\naiperf ran {time.monotonic() - t0:.1f} s")
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    exports = glob.glob(str(art / "**" / "profile_export_aiperf.json"), recursive=True)
    assert exports, (res.stdout + res.stderr)[-3000:]
    summary = json.loads(Path(exports[0]).read_text())
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0.0, summary["error_summary"]
    assert summary["completed_request_count"]["avg"] == requests and summary["request_count"]["avg"] == requests
    assert summary["time_to_first_token"]["count"] == requests  # streamed: a first token seen per request
    records = [json.loads(ln) for ln in Path(exports[0]).with_name("profile_export.jsonl").read_text().splitlines()]
    # ignore_eos: every request streamed exactly the tokens it asked for (by the server's usage)
    assert [r["metrics"]["usage_completion_tokens"]["value"] for r in records] == [osl] * requests
    print(f"aiperf: {requests} requests, TTFT p50 {summary['time_to_first_token']['p50']:.0f} ms, "
          f"ITL p50 {summary['inter_token_latency']['p50']:.0f} ms")
