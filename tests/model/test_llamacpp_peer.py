"""bench/llamacpp_peer.py skips cleanly, with one line saying how to install it, where
llama-cpp-python is not importable (it is never a dependency of the suite)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parents[2] / "bench" / "llamacpp_peer.py"


def test_peer_is_skipped_when_llama_cpp_is_not_importable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, installed or not
    spec = importlib.util.spec_from_file_location("llamacpp_peer", PEER)
    assert spec is not None and spec.loader is not None
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)

    assert peer.open_peer(tmp_path / "model.gguf", threads=2, n_ctx=64) is None
    assert capsys.readouterr().out == "llama.cpp: not installed (make bench-llamacpp)\n"
