"""The layers of src/cuda (src/cuda/README.md): every file in a layer's folder, no include of a
layer above (scripts/check_cuda_layers.py)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_cuda_layers", ROOT / "scripts" / "check_cuda_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_files_include_only_their_layer_and_the_ones_below():
    assert _checker().problems(ROOT) == []


def test_the_check_finds_an_include_from_above(tmp_path):
    cuda = tmp_path / "src" / "cuda"
    (cuda / "common").mkdir(parents=True)
    (cuda / "host").mkdir()
    (cuda / "host" / "launch.h").write_text("")
    (cuda / "common" / "utils.h").write_text('#include "cuda/host/launch.h"\n')
    (cuda / "stray.h").write_text("")
    found = _checker().problems(tmp_path)
    assert any("common/utils.h: includes cuda/host/launch.h" in line for line in found)
    assert any("stray.h: not in a layer's folder" in line for line in found)
