"""scripts/nvrtc_check.py without NVRTC: it reads the CUDA backend's compile settings from
runtime.py's source (importing runtime.py needs CuPy), and says what to install when NVRTC is
missing. (With NVRTC it compiles every kernel file; that run is a developer's, not CI's.)"""
from __future__ import annotations

import _scripts


def load():
    return _scripts.load("scripts/nvrtc_check.py")


def test_reads_the_backends_include_line_and_arch_targets():
    include, arch_stems = load().runtime_constants()
    assert include == '#include "common.cuh"'
    assert arch_stems["flash_hopper"][1] == "sm_90a"
    cu = {p.stem for p in load().CUDA_DIR.glob("*.cu")}
    assert set(arch_stems) <= cu and "flash_hopper" in cu
    for stem in cu:          # every file has the line the loader replaces
        assert include in (load().CUDA_DIR / f"{stem}.cu").read_text(), stem


def test_without_nvrtc_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setenv("FORGE_NVRTC", "/nonexistent/libnvrtc.so")
    assert load().main([]) == 2
    assert "pip install nvidia-cuda-nvrtc-cu12" in capsys.readouterr().out
