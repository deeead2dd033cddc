"""Build megatrain._C (and the benchmark kernels, megatrain._bench) against the torch already installed.

    pip install --no-build-isolation -e .

torch is deliberately not a build or install requirement: pip would otherwise replace the
installed (possibly CUDA) torch with whatever wheel it resolves. Install torch first.

Environment:
    MEGATRAIN_WITH_CUDA=auto|0|1   auto (default): CUDA on when torch is a CUDA build and a CUDA
                                   toolkit is found (CUDA_HOME); never keyed on a visible GPU.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - build-time guidance
    sys.exit(
        "megatrain builds against an installed torch: install torch first, then run "
        "`pip install --no-build-isolation -e .`"
    )

ROOT = Path(__file__).parent.resolve()
VERSION = "0.1.0"
ISA_VARIANTS = {"adam_scalar.cpp": "scalar", "adam_avx2.cpp": "avx2", "adam_avx512.cpp": "avx512"}


def _source_list(name):
    lines = (ROOT / "csrc" / name).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def core_sources():
    """The torch-free core: the one list shared with CMakeLists.txt."""
    return _source_list("core_sources.txt")


def bench_sources():
    """megatrain._bench: the STREAM kernels (csrc/bench_sources.txt, shared with CMakeLists.txt), the
    CPU feature detection they dispatch on, and their bindings (csrc/megatrain/bindings/bench/)."""
    bdir = ROOT / "csrc" / "megatrain" / "bindings" / "bench"
    return (_source_list("bench_sources.txt") + ["csrc/megatrain/common/cpu_features.cpp"]
            + sorted(str(p.relative_to(ROOT)) for p in bdir.glob("*.cpp")))


def binding_sources():
    bdir = ROOT / "csrc" / "megatrain" / "bindings"
    return sorted(str(p.relative_to(ROOT)) for p in bdir.glob("*.cpp"))


def cuda_sources():
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))


def want_cuda():
    mode = os.environ.get("MEGATRAIN_WITH_CUDA", "auto").strip().lower()
    available = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode in ("0", "off", "false", "no"):
        return False
    if mode in ("1", "on", "true", "yes"):
        if not available:
            raise RuntimeError(
                "MEGATRAIN_WITH_CUDA=1 but torch.version.cuda="
                f"{torch.version.cuda!r} and CUDA_HOME={cpp_extension.CUDA_HOME!r}: a CUDA build of "
                "torch and a CUDA toolkit (nvcc, set CUDA_HOME) are both required"
            )
        return True
    if mode != "auto":
        raise RuntimeError(f"MEGATRAIN_WITH_CUDA must be auto, 0 or 1, got {mode!r}")
    return available


def git_sha():
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, stderr=subprocess.DEVNULL, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def csrc_hash():
    """megatrain._source_hash.csrc_hash of csrc/ (loaded from its file: the package needs torch and _C)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_megatrain_source_hash", ROOT / "python" / "megatrain" / "_source_hash.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.csrc_hash(ROOT / "csrc")


WITH_CUDA = want_cuda()
SOURCES = core_sources() + binding_sources() + (cuda_sources() if WITH_CUDA else [])
ISAS = [isa for name, isa in ISA_VARIANTS.items() if any(s.endswith(name) for s in SOURCES)]
if os.uname().machine not in ("x86_64", "AMD64"):
    ISAS = ["scalar"]  # the vector variants compile to nothing off x86-64

BUILD_INFO = {
    "version": VERSION,
    "torch_version": torch.__version__,
    "cuda_version": torch.version.cuda if WITH_CUDA else None,
    "with_cuda": WITH_CUDA,
    "isas_compiled": ISAS,
    "git_sha": git_sha(),
    "csrc_sha256": csrc_hash(),  # checked at import in a source tree (megatrain._source_hash)
    "python_version": ".".join(map(str, sys.version_info[:3])),
}

# Same-rounding guarantee between ISA variants: no FMA contraction, no fast-math. No -march:
# ISA flags are per file (MEGATRAIN_ISA_TARGET_BEGIN in csrc/megatrain/cpu_adam/kernels/adam_<isa>.cpp,
# csrc/megatrain/common/simd/isa_target.h).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]  # -fopenmp: at::parallel_for is a header template; without it our op runs on one thread
NVCC_FLAGS = ["-O3", "-gencode", "arch=compute_90,code=sm_90"]


def _c_string(s):
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


# A second, static copy of libstdc++ inside _C crashes the process the first time _C formats a
# number into an error message (its std::ostream code runs against the std::locale state of the
# libstdc++.so.6 that torch loaded; Ubuntu's -Wl,-Bsymbolic-functions binds our calls to our copy
# while data still resolves to the shared one): seen on the H200 machine (NEEDED had libm but no
# libstdc++.so.6, i.e. a g++ link that took libstdc++ from an archive). Two ways in: a
# -static-libstdc++ in the inherited flags (dropped below), or a lone libstdc++.a in a directory
# searched before the toolchain's (any -L on the link line). SHARED_LIBSTDCXX names the shared
# runtime itself, ahead of the driver's own -lstdc++, so neither can pull a static copy in, and
# BuildExt checks the linked file. Extensions must share torch's C++ runtime.
STATIC_RUNTIME_FLAGS = ("-static-libstdc++", "-static-libgcc")
SHARED_LIBSTDCXX = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def _drop_static_runtime_flags(compiler):
    for key in ("compiler", "compiler_so", "compiler_cxx", "linker_so", "linker_so_cxx", "linker_exe", "linker_exe_cxx"):
        cmd = getattr(compiler, key, None)
        if isinstance(cmd, list) and any(f in cmd for f in STATIC_RUNTIME_FLAGS):
            print(f"megatrain setup.py: dropping {[f for f in cmd if f in STATIC_RUNTIME_FLAGS]} from {key} "
                  "(the extension must use torch's shared libstdc++)")
            setattr(compiler, key, [f for f in cmd if f not in STATIC_RUNTIME_FLAGS])


def _check_shared_runtime(path):
    """Fail the build (not the first error message at run time) if libstdc++ got linked into _C."""
    if not SHARED_LIBSTDCXX or shutil.which("readelf") is None:
        return
    dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", path], capture_output=True, text=True).stdout
    own = [ln.split()[-1] for ln in syms.splitlines() if "_ZNSo9_M_insert" in ln and " UND " not in ln]
    if "libstdc++.so" not in dyn or own:
        raise RuntimeError(
            f"{path} does not share torch's libstdc++.so.6 (in NEEDED: {'libstdc++.so' in dyn}; defines "
            f"{own[:3]} itself): a static copy crashes formatting error messages. Look for -static-libstdc++ or "
            "a libstdc++.a under a -L directory in the link command (pip install -v ...)."
        )


class BuildExt(cpp_extension.BuildExtension):
    """Writes the build-info header (compiled into _C) before compiling, and _build_info.json after."""

    def build_extensions(self):
        gen_dir = Path(self.build_temp).resolve() / "megatrain_gen"
        gen_dir.mkdir(parents=True, exist_ok=True)
        header = [
            "// Generated by setup.py; do not edit.",
            "#pragma once",
            f"#define MEGATRAIN_VERSION_STR {_c_string(BUILD_INFO['version'])}",
            f"#define MEGATRAIN_GIT_SHA_STR {_c_string(BUILD_INFO['git_sha'])}",
            f"#define MEGATRAIN_TORCH_VERSION_STR {_c_string(BUILD_INFO['torch_version'])}",
        ]
        if BUILD_INFO["cuda_version"] is not None:
            header.append(f"#define MEGATRAIN_CUDA_VERSION_STR {_c_string(BUILD_INFO['cuda_version'])}")
        text = "\n".join(header) + "\n"
        path = gen_dir / "megatrain_build_info_gen.h"
        if not path.exists() or path.read_text() != text:  # keep ninja's timestamps stable
            path.write_text(text)
        for ext in self.extensions:
            ext.include_dirs.append(str(gen_dir))
        _drop_static_runtime_flags(self.compiler)

        super().build_extensions()
        for ext in self.extensions:
            _check_shared_runtime(self.get_ext_fullpath(ext.name))
        # after a successful build only: its csrc_sha256 vouches for the extension next to it
        payload = json.dumps(BUILD_INFO, indent=2) + "\n"
        targets = [ROOT / "python" / "megatrain" / "_build_info.json"]
        if not self.inplace and self.build_lib:
            targets.append(Path(self.build_lib) / "megatrain" / "_build_info.json")
        for t in targets:
            t.parent.mkdir(parents=True, exist_ok=True)
            t.write_text(payload)


def make_extension():
    kwargs = dict(
        name="megatrain._C",
        sources=SOURCES,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": list(CXX_FLAGS)},
        extra_link_args=["-fopenmp"] + SHARED_LIBSTDCXX,
    )
    if WITH_CUDA:
        kwargs["define_macros"] = [("MEGATRAIN_WITH_CUDA", None)]
        kwargs["extra_compile_args"]["nvcc"] = list(NVCC_FLAGS)
        return cpp_extension.CUDAExtension(**kwargs)
    return cpp_extension.CppExtension(**kwargs)


def make_bench_extension():
    return cpp_extension.CppExtension(
        name="megatrain._bench",
        sources=bench_sources(),
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={"cxx": list(CXX_FLAGS)},
        extra_link_args=["-fopenmp"] + SHARED_LIBSTDCXX,
    )


setup(
    version=VERSION,
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    package_data={"megatrain": ["_build_info.json"]},
    ext_modules=[make_extension(), make_bench_extension()],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
    zip_safe=False,
)
