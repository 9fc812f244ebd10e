"""Where the o200k vocabulary comes from: the one place every process that tokenizes asks.

gpt-oss's tokenizer (o200k_harmony) is o200k_base.tiktoken plus harmony's special tokens. openai-harmony
loads that file from the folder in $TIKTOKEN_ENCODINGS_BASE and otherwise downloads it, which fails on a
machine without internet access; the structured-output grammar (engine/grammar.py) reads the same file.
So the file ships with kvrelay as package data (engine/o200k-vocab/, MIT, published by OpenAI with
tiktoken: engine/o200k-vocab/LICENSE), and $TIKTOKEN_ENCODINGS_BASE, when set, overrides it. (The folder's
name is no Python identifier, so setuptools does not take it for an undeclared package.)

The router, its render-pool helper process, the workers (structured outputs) and `kvrelay generate` all
resolve it here; `kvrelay serve` and `kvrelay config check` check it before anything starts
(cluster/preflight.py), so a server without its vocabulary never says it is ready. Torch-free.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
# The hash tiktoken's openai_public.py (and openai-harmony's loader) expect for o200k_base: a copy that
# differs is truncated or corrupt, and would tokenize wrongly rather than fail.
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
PACKAGED_DIR = Path(__file__).resolve().parent / "o200k-vocab"


class VocabularyError(RuntimeError):
    """The vocabulary cannot be used; the message is one line that names the fix."""


def override() -> str | None:
    """$TIKTOKEN_ENCODINGS_BASE when it names another folder than the packaged one (which `export` sets)."""
    base = os.environ.get(ENV)
    return base if base and base != str(PACKAGED_DIR) else None


def vocab_dir() -> Path:
    """$TIKTOKEN_ENCODINGS_BASE when set, else the copy installed with the package."""
    base = override()
    return Path(base) if base else PACKAGED_DIR


def vocab_file() -> Path:
    """The file, checked: raises VocabularyError when it is missing or is not o200k_base."""
    path = vocab_dir() / VOCAB_FILE
    base = override()
    fix = f"unset {ENV} to use the copy shipped with kvrelay" if base else "reinstall kvrelay (pip install .)"
    try:
        st = path.stat()
    except OSError:
        if base:
            raise VocabularyError(f"{ENV}={base} has no {VOCAB_FILE}: {fix}, or point it at a folder that "
                                  "holds the file") from None
        raise VocabularyError(f"{VOCAB_FILE} is missing from the installed package ({PACKAGED_DIR}): {fix}, "
                              f"or set {ENV} to a folder that holds the file") from None
    digest = _sha256(str(path), st.st_size, st.st_mtime_ns)
    if digest != SHA256:
        raise VocabularyError(f"{path} is not o200k_base (sha256 {digest[:16]}..., expected {SHA256[:16]}...), "
                              f"corrupt or another vocabulary: {fix}")
    return path


@functools.lru_cache(maxsize=4)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per file version (~10 ms for its 3.6 MB): every check after the first is a stat."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def export() -> Path:
    """Check the vocabulary and point $TIKTOKEN_ENCODINGS_BASE at its folder, so openai-harmony in this
    process, and every process started from it afterwards (Ray workers, the render pool's helper), loads
    it offline instead of trying to download it. Returns the file."""
    path = vocab_file()
    os.environ[ENV] = str(path.parent)
    return path
