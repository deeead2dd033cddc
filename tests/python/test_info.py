"""`python -m megatrain.info` and the build facts it reports."""

import os
import subprocess
import sys

from megatrain._ext import _C as C


def _run_info(**env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-m", "megatrain.info"], capture_output=True, text=True,
                          env=full_env, timeout=120)


def test_info_prints_versions_and_the_chosen_isa():
    r = _run_info()
    assert r.returncode == 0, r.stderr
    isa = C.cpu_isa()
    assert f"CPU ISA: {isa}" in r.stdout
    assert "megatrain 0.1.0" in r.stdout
    import torch
    assert f"installed {torch.__version__}" in r.stdout


def test_info_honours_megatrain_cpu_isa_override():
    r = _run_info(MEGATRAIN_CPU_ISA="scalar")
    assert r.returncode == 0, r.stderr
    assert "CPU ISA: scalar" in r.stdout


def test_info_reports_an_invalid_isa_override_instead_of_crashing():
    r = _run_info(MEGATRAIN_CPU_ISA="avx9000")
    assert r.returncode == 0, r.stderr
    assert "CPU ISA: ERROR" in r.stdout and "avx9000" in r.stdout


def test_build_info_keys_and_isas():
    info = C.build_info()
    for key in ("version", "torch_version", "cuda_version", "with_cuda", "isas_compiled", "cpu_isa", "git_sha"):
        assert key in info, key
    assert "scalar" in info["isas_compiled"]
    assert set(C.supported_isas()) <= set(info["isas_compiled"])
    assert info["cpu_isa"] in C.supported_isas()
    assert (info["cuda_version"] is None) == (not info["with_cuda"])
