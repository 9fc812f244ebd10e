"""The o200k vocabulary ships with kvrelay (engine/vocab.py, engine/o200k-vocab/): found with no environment,
checked against tiktoken's published hash, overridable by $TIKTOKEN_ENCODINGS_BASE; a server that cannot
load it refuses to start (`kvrelay serve` and `kvrelay config check`, one line naming the fix) instead of
saying it is ready and answering every chat with a 500."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from kvrelay.cluster.cli import main
from kvrelay.cluster.preflight import PreflightError, check_vocabulary
from kvrelay.engine import grammar, vocab

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(vocab.ENV, raising=False)
    yield
    os.environ.pop(vocab.ENV, None)  # export() sets it; monkeypatch does not undo a variable it deleted


def test_the_packaged_vocabulary_is_used_without_the_variable(no_override):
    path = vocab.vocab_file()
    assert path == vocab.PACKAGED_DIR / "o200k_base.tiktoken"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == vocab.SHA256
    assert (vocab.PACKAGED_DIR / "LICENSE").read_text().count("MIT License") == 1
    assert vocab.export() == path and os.environ[vocab.ENV] == str(vocab.PACKAGED_DIR)
    assert vocab.override() is None  # what export() set is the packaged folder, not an override
    assert check_vocabulary() == ("vocabulary o200k_base.tiktoken (shipped with kvrelay): sha256 as tiktoken "
                                  "publishes it, harmony loads it")
    ranks = grammar.mergeable_ranks()  # the structured-output grammar reads the same file
    assert len(ranks) == 199998 and ranks[b"hello"] < 199998


def test_an_override_without_the_file_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(vocab.ENV, str(tmp_path))
    want = (f"TIKTOKEN_ENCODINGS_BASE={tmp_path} has no o200k_base.tiktoken: unset TIKTOKEN_ENCODINGS_BASE to "
            "use the copy shipped with kvrelay, or point it at a folder that holds the file")
    with pytest.raises(vocab.VocabularyError) as e:
        vocab.vocab_file()
    assert str(e.value) == want
    with pytest.raises(PreflightError) as e:  # even with the encoding already loaded and cached
        check_vocabulary()
    assert str(e.value) == want
    with pytest.raises(vocab.VocabularyError):
        grammar.mergeable_ranks()


def test_a_corrupt_file_is_refused(tmp_path, monkeypatch):
    data = bytearray((vocab.PACKAGED_DIR / vocab.VOCAB_FILE).read_bytes())
    data[1000] ^= 1  # one flipped bit somewhere in one token's base64
    (tmp_path / vocab.VOCAB_FILE).write_bytes(bytes(data))
    monkeypatch.setenv(vocab.ENV, str(tmp_path))
    with pytest.raises(vocab.VocabularyError, match=r"is not o200k_base \(sha256 [0-9a-f]{16}\.\.\., expected "
                                                   r"446a9538cb6c348e\.\.\.\), corrupt or another vocabulary: unset"):
        vocab.vocab_file()
    shutil.copy(vocab.PACKAGED_DIR / vocab.VOCAB_FILE, tmp_path / vocab.VOCAB_FILE)  # a good copy elsewhere: fine
    assert vocab.vocab_file() == tmp_path / vocab.VOCAB_FILE and vocab.override() == str(tmp_path)


def test_config_check_refuses_an_override_without_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(vocab.ENV, str(tmp_path))
    assert main(["config", "check", "cpu-tiny.yaml"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: TIKTOKEN_ENCODINGS_BASE={tmp_path} has no o200k_base.tiktoken: unset "
                       "TIKTOKEN_ENCODINGS_BASE to use the copy shipped with kvrelay, or point it at a folder "
                       "that holds the file")


def test_config_check_lists_the_vocabulary(no_override, capsys):
    assert main(["config", "check", "cpu-tiny.yaml"]) == 0
    assert "  vocabulary o200k_base.tiktoken (shipped with kvrelay): sha256" in capsys.readouterr().out


def test_serve_without_its_vocabulary_exits_before_starting_anything(tmp_path):
    env = dict(os.environ, TIKTOKEN_ENCODINGS_BASE=str(tmp_path))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "kvrelay.cluster.cli", "serve", "cpu-tiny.yaml", "--http-port", "0",
                          "--grpc-port", "0"], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: TIKTOKEN_ENCODINGS_BASE={tmp_path} has no o200k_base.tiktoken: unset TIKTOKEN_ENCODINGS_BASE to "
        "use the copy shipped with kvrelay, or point it at a folder that holds the file")
    assert "kvrelay: starting" not in out.stdout
    assert time.monotonic() - t0 < 60
