"""The built extension shares torch's C++ runtime (no static copy of libstdc++ inside _C)."""
import shutil
import subprocess

import pytest

import megatrain._C as C


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_extension_links_the_shared_libstdcxx():
    # A static libstdc++ copy in _C crashed the process on the H200 machine the first time an
    # error message formatted a number (two std::locale worlds in one process).
    dyn = subprocess.run(["readelf", "-d", C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in dyn, f"{C.__file__} does not link libstdc++ dynamically:\n{dyn}"
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", C.__file__], capture_output=True, text=True, check=True).stdout
    own = [ln for ln in syms.splitlines() if "_ZNSo9_M_insert" in ln and " UND " not in ln]
    assert not own, "the extension defines libstdc++'s std::ostream internals itself:\n" + "\n".join(own[:5])


def test_error_message_with_numbers_after_many_ops():
    # The crash needed a formatted integer in the message; run it after the op has run.
    import torch
    import megatrain.ops as ops
    p, m, v = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        ops.adamw_step_(p, m, v, torch.ones(64), None, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="must have 64"):
        ops.adamw_step_(p, m, torch.zeros(63), torch.ones(64), None, lr=1e-3, step=1)
