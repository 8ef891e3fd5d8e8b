"""Offline vocabulary: regenerated from quicktok, verified, the user's TIKTOKEN_ENCODINGS_BASE wins, and
a clear one-line failure at start-up when neither works."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harmony_gateway.harmony import vocab


def test_materialized_file_matches_the_official_hash(tmp_path: Path) -> None:
    path = vocab.materialize_vocab(tmp_path)
    assert path.name == "o200k_base.tiktoken"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == vocab.VOCAB_SHA256
    mtime = path.stat().st_mtime_ns
    assert vocab.materialize_vocab(tmp_path) == path  # verified, not rewritten
    assert path.stat().st_mtime_ns == mtime


def test_corrupt_cached_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / vocab.VOCAB_FILE).write_text("garbage")
    path = vocab.materialize_vocab(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == vocab.VOCAB_SHA256


def test_user_setting_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "mine"))
    monkeypatch.setenv("HARMONY_GATEWAY_CACHE_DIR", str(tmp_path / "cache"))
    assert vocab.ensure_vocab_env() == tmp_path / "mine"
    assert not (tmp_path / "cache").exists()


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARMONY_GATEWAY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert vocab.default_cache_dir() == tmp_path / "harmony-gateway"


def test_start_up_fails_with_one_line_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    env["HARMONY_GATEWAY_CACHE_DIR"] = str(blocker)  # a file: the vocab folder cannot be created
    proc = subprocess.run(
        [sys.executable, "-m", "harmony_gateway.cli", "serve", "--worker-url", "grpc://127.0.0.1:1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "TIKTOKEN_ENCODINGS_BASE" in lines[0]
