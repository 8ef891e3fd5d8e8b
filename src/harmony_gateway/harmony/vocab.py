"""Offline provisioning of the o200k vocabulary that openai-harmony loads.

openai-harmony downloads `o200k_base.tiktoken` on first use, which fails offline. We regenerate the file
from the `quicktok-v1` package (byte-identical to the upstream file, checked by sha256) into a cache folder
and point `TIKTOKEN_ENCODINGS_BASE` at it. A user's own `TIKTOKEN_ENCODINGS_BASE` always wins.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from pathlib import Path

import quicktok

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ORDINARY_RANKS = 199998


class VocabularyUnavailable(RuntimeError):
    """Raised when the vocabulary can be neither found nor generated; the message says what to set."""


def default_cache_dir() -> Path:
    explicit = os.environ.get("HARMONY_GATEWAY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "harmony-gateway"


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def render_vocab_bytes() -> bytes:
    """The o200k_base.tiktoken file, rebuilt from quicktok: `base64(bytes) rank\\n` for every ordinary rank."""
    enc = quicktok.get_encoding("o200k_base")
    lines = [
        base64.b64encode(enc.decode_single_token_bytes(rank)).decode("ascii") + " " + str(rank) + "\n"
        for rank in range(ORDINARY_RANKS)
    ]
    return "".join(lines).encode("ascii")


def materialize_vocab(folder: Path) -> Path:
    """Write the vocabulary into `folder` (atomically, so concurrent processes never see half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / VOCAB_FILE
    if target.exists() and _sha256_of(target) == VOCAB_SHA256:
        return target
    data = render_vocab_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != VOCAB_SHA256:
        raise VocabularyUnavailable(
            f"quicktok-v1 produced an o200k vocabulary with sha256 {actual}, expected {VOCAB_SHA256}; "
            "set TIKTOKEN_ENCODINGS_BASE to a folder holding the official o200k_base.tiktoken"
        )
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)
    return target


def ensure_vocab_env() -> Path:
    """Make `TIKTOKEN_ENCODINGS_BASE` point at a folder holding a verified vocabulary; return that folder."""
    user_base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if user_base:
        return Path(user_base)
    folder = default_cache_dir() / "vocab"
    try:
        materialize_vocab(folder)
    except VocabularyUnavailable:
        raise
    except Exception as exc:  # ImportError, OSError: say what to set, in one line
        raise VocabularyUnavailable(
            f"cannot prepare the o200k vocabulary in {folder} ({exc.__class__.__name__}: {exc}); "
            "set TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken, "
            "or HARMONY_GATEWAY_CACHE_DIR to a writable folder"
        ) from exc
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return folder
