"""``python -m megatrain.info``: what megatrain was built with, and what it runs with now.

Prints the megatrain version, the torch / CUDA versions it was built against and those installed,
the compiled and chosen CPU ISA, and whether CUDA is compiled in and usable. Exits 1 (after
printing the mismatch) when the extension cannot be loaded.
"""

import sys

from .byte_units import format_bytes


def collect() -> dict:
    """Build and runtime facts as a dict (raises ImportError when ``megatrain._C`` cannot load)."""
    import torch

    from megatrain._ext import _C

    info = dict(_C.build_info())
    info["torch_version_now"] = torch.__version__
    info["cuda_version_now"] = torch.version.cuda
    info["cuda_usable"] = bool(info["with_cuda"]) and torch.cuda.is_available()
    info["torch_threads"] = torch.get_num_threads()
    from megatrain.runtime.placement.host_memory import host_memory_limits

    info["memory"] = host_memory_limits()
    return info


def _gib(x):
    return format_bytes(x, decimals=1, smallest="MiB", none="unlimited")


def main(argv=None) -> int:
    try:
        info = collect()
    except ImportError as err:
        print(f"megatrain: extension failed to load\n{err}", file=sys.stderr)
        return 1
    mem = info["memory"]
    lines = [
        f"megatrain {info['version']} (git {info['git_sha']})",
        f"torch: built against {info['torch_version']}, installed {info['torch_version_now']}",
        f"CUDA: built against {info['cuda_version']}, installed torch uses {info['cuda_version_now']}",
        f"CUDA compiled in: {info['with_cuda']}; usable now: {info['cuda_usable']}",
        f"CPU ISA: {info['cpu_isa'] or 'ERROR: ' + str(info['cpu_isa_error'])} "
        f"(compiled: {', '.join(info['isas_compiled'])}; supported here: {', '.join(info['isas_supported'])})",
        f"torch CPU threads: {info['torch_threads']}",
        f"host memory: available {_gib(mem['mem_available_bytes'])}, cgroup limit {_gib(mem['cgroup_limit_bytes'])}, "
        f"memlock {_gib(mem['memlock_bytes'])}",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
