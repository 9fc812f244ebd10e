"""`kvrelay generate` end to end, in process (the CLI table, argument parsing, JSON output, errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.cluster.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
pytestmark = pytest.mark.usefixtures("model_single_thread")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["generate", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_prompt_ids_greedy_json_matches_reference(capsys):
    ref = json.loads((FIXTURE / "reference.json").read_text())["runs"][2]
    rc, out, _ = _run(capsys, "--model", str(FIXTURE), "--prompt-ids", ",".join(map(str, ref["prompt"])),
                      "--max-new-tokens", "4", "--greedy", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["token_ids"] == ref["greedy"][:4]
    assert result["text"] == " ".join(map(str, ref["greedy"][:4])) and result["text_is_ids"]
    assert result["finish_reason"] == "length" and len(result["logprobs"]) == 4


def test_seeded_sampling_is_reproducible(capsys):
    args = ("--model", str(FIXTURE), "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "5", "--json")
    first = json.loads(_run(capsys, *args)[1])["token_ids"]
    assert json.loads(_run(capsys, *args)[1])["token_ids"] == first


def test_harmony_prompt_on_full_vocab_dummy(capsys, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)  # the vocabulary shipped with the package
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", "/nonexistent")  # and no download cache to fall back on
    rc, out, _ = _run(capsys, "--model", "gpt-oss-tiny", "--dummy", "--prompt", "Hello", "--max-new-tokens", "3",
                      "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["prompt_ids"][0] == 200006 and result["prompt_ids"][-1] == 173781  # <|start|> ... assistant
    assert len(result["token_ids"]) <= 3 and isinstance(result["text"], str)


def test_clear_errors(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # an override without the file
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", "/nonexistent")  # no cached vocab either
    rc, _, err = _run(capsys, "--model", "tiny", "--dummy", "--prompt", "Hi")
    assert rc == 2 and f"TIKTOKEN_ENCODINGS_BASE={tmp_path} has no o200k_base.tiktoken: unset" in err
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    rc, _, err = _run(capsys, "--model", "tiny", "--dummy", "--prompt", "Hi")  # the packaged one loads
    assert rc == 2 and "has a vocabulary of 1024" in err, err
    rc, _, err = _run(capsys, "--model", str(FIXTURE), "--prompt-ids", "1,x")
    assert rc == 2 and "comma-separated" in err
    rc, _, err = _run(capsys, "--model", str(FIXTURE), "--prompt-ids", "1,99999")
    assert rc == 2 and "outside" in err
    rc, _, err = _run(capsys, "--model", "no-such-model", "--prompt-ids", "1")
    assert rc == 2 and "preset" in err
