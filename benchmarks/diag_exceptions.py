"""Which C++ exceptions reach Python on this machine, and which crash the process.

Each case runs in its own child process (a segfault there is reported, not fatal here):
  ours_op        megatrain's TORCH_LIBRARY op with a non-contiguous tensor (TORCH_CHECK_VALUE)
  ours_pybind    a megatrain._C pybind11 function that throws (set_cpu_isa with a bad name)
  inline_*       a minimal extension built here by torch.utils.cpp_extension.load_inline, with
                 torch's default flags and with megatrain's (-O3 -fopenmp ...): TORCH_CHECK and
                 std::runtime_error thrown from a pybind11 function
Prints one line per case: rc (negative = killed by that signal) and the exception text seen.

    python3 benchmarks/diag_exceptions.py [--build-dir DIR]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

CASES = {
    "ours_op": """
        import torch, megatrain.ops as ops
        big = torch.zeros(128); p = big[::2]
        m, v, g = torch.zeros(64), torch.zeros(64), torch.ones(64)
        ops.adamw_step_(p, m, v, g, None, lr=1e-3, step=1)
    """,
    "ours_pybind": """
        import torch, megatrain._C as C
        C.set_cpu_isa("no-such-isa")
    """,
}

INLINE_SRC = r"""
#include <torch/extension.h>
#include <stdexcept>
void check_fail() { TORCH_CHECK(false, "inline TORCH_CHECK message"); }
void runtime_fail() { throw std::runtime_error("inline runtime_error message"); }
"""

INLINE_CASE = """
    import torch
    from torch.utils.cpp_extension import load_inline
    mod = load_inline(name={name!r}, cpp_sources=[{src!r}], functions=["check_fail", "runtime_fail"],
                      extra_cflags={cflags!r}, extra_ldflags={ldflags!r}, build_directory={bdir!r})
    try:
        mod.check_fail()
    except Exception as e:
        print("caught", type(e).__name__, str(e).splitlines()[0])
    mod.runtime_fail()
"""


def run_case(name, code):
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
                       capture_output=True, text=True, timeout=600)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    seen = [ln for ln in lines if "Error" in ln or "caught" in ln or "Fatal" in ln or "terminate" in ln]
    print(f"{name:<22} rc={p.returncode:<4} {' | '.join(seen[-3:])[:300]}", flush=True)
    return p.returncode


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=tempfile.mkdtemp(prefix="mt_diag_"))
    args = ap.parse_args()
    for name, code in CASES.items():
        run_case(name, code)
    variants = {
        "inline_default": ([], []),
        "inline_megatrain_flags": (["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"], ["-fopenmp"]),
    }
    for name, (cflags, ldflags) in variants.items():
        bdir = os.path.join(args.build_dir, name)
        os.makedirs(bdir, exist_ok=True)
        run_case(name, INLINE_CASE.format(name="mt_diag_" + name, src=INLINE_SRC, cflags=cflags,
                                          ldflags=ldflags, bdir=bdir))


if __name__ == "__main__":
    main()
