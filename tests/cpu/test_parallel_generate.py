"""`kvrelay generate --tp N [--ep N]`: N spawned CPU ranks over gloo load their slices of a real
(original-format, MXFP4 experts) checkpoint and must reproduce the reference implementation's greedy
tokens, like the single-process run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.cluster.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "gpt-oss-tiny-original"
pytestmark = pytest.mark.timeout(240)


def _generate(capsys, *args: str) -> tuple[int, dict | None, str]:
    rc = main(["generate", "--model", str(FIXTURE), *args])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


@pytest.mark.parametrize("tp,ep", [(2, 2), (2, 1), (4, 4)])
def test_tp_generate_matches_reference(capsys, tp, ep):
    # Run 1 of the reference: every one of its first 8 greedy steps wins by a logit margin > 0.3, far
    # above the bf16 rounding that sharding reorders, so any token difference is a real error.
    ref = json.loads((FIXTURE / "reference.json").read_text())["runs"][1]
    rc, result, err = _generate(capsys, "--prompt-ids", ",".join(map(str, ref["prompt"])), "--max-new-tokens",
                                "8", "--greedy", "--json", "--tp", str(tp), "--ep", str(ep))
    assert rc == 0, err
    assert result["token_ids"] == ref["greedy"][:8]
    assert (result["tp"], result["ep"]) == (tp, ep)
    per_rank = result["weight_bytes_per_rank"]
    _, single, _ = _generate(capsys, "--prompt-ids", "1", "--max-new-tokens", "1", "--json")
    whole = single["weight_bytes_per_rank"][0]
    print(f"EP{ep} TP{tp}: weights per rank {[round(b / 2**20, 3) for b in per_rank]} MiB, single {whole / 2**20:.3f} MiB")
    assert len(per_rank) == tp and max(per_rank) < whole


def test_tp_errors_are_clear(capsys):
    rc, _, err = _generate(capsys, "--prompt-ids", "1,2", "--tp", "3")
    assert rc == 2 and "num_attention_heads=8 is not divisible by 3 ranks" in err
    rc, _, err = _generate(capsys, "--prompt-ids", "1,2", "--tp", "2", "--ep", "4")
    assert rc == 2 and "--ep either 1 or --tp" in err
    rc, _, err = _generate(capsys, "--prompt-ids", "1,2", "--tp", "2", "--device", "cuda")
    assert rc == 2 and ("--tp > 1 spawns CPU ranks" in err or "no CUDA device" in err)
