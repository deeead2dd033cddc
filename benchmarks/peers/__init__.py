"""Peer systems of benchmarks/bench_train.py whose code lives outside this repository.

``megatrain_official`` (github.com/DLYuanGod/MegaTrain) and ``slideformer``
(github.com/RegiaYoung/SlideFormer) are read from ``$MEGATRAIN_PEERS_DIR/<name>/`` (default: ``.peers/``
under the repository root, git-ignored), a plain checkout of the peer's public source; nothing of
theirs is copied into this repository. Each adapter builds bench_train's seeded Llama, drives the
peer's own Python API for ``warmup + steps`` optimizer steps on bench_train's random token batches and
returns the same row fields as the other systems, plus ``precision`` (the master-weight dtype the
peer keeps, ``"bf16"`` or ``"fp32"``), ``clips`` (whether this row clipped the global gradient norm),
``clip_support`` and ``peer_source``. Where the peer's code decides these, the adapter's docstring
cites the file and line it was read from.

A peer whose source is missing, or that cannot run the spec (e.g. SlideFormer with gradient
accumulation), gives a row whose status starts with ``skipped:`` (:func:`skip_reason`), not a crash.
"""
from __future__ import annotations

import importlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER_REPOS = {"megatrain_official": "github.com/DLYuanGod/MegaTrain",
              "slideformer": "github.com/RegiaYoung/SlideFormer"}
# a file each adapter needs, relative to the peer's source root: its presence marks a usable tree
PEER_MARKERS = {"megatrain_official": "infinity/model/cpu_master.py",
                "slideformer": "offload_transformer.py"}


# Peak host bytes per parameter of each peer's child (the harness's fp32 model included), measured at 3.37B on
# the H200 (docs/benchmarks/peers_3b_clip_direct_h200.json, 2026-12-05: SlideFormer 43.1 GiB, the official code 50.4):
# the parent skips a size whose projected need exceeds the host's available memory (it would fail to pin or swap).
HOST_BYTES_PER_PARAM = {"megatrain_official": 16.1, "slideformer": 13.8}


def host_skip_reason(name: str, n_params: int, available: int | None) -> str | None:
    """``"skipped: ..."`` when ``HOST_BYTES_PER_PARAM[name] * n_params`` exceeds ``available`` host bytes, else None."""
    need = HOST_BYTES_PER_PARAM[name] * n_params
    if available is None or need <= available:
        return None
    return (f"skipped: {name} would need ~{need / 2**30:.0f} GiB of host memory ({HOST_BYTES_PER_PARAM[name]} B/param "
            f"as measured at 3.37B, {n_params / 1e9:.2f}B params); {available / 2**30:.0f} GiB available")


def peers_dir() -> str:
    """``$MEGATRAIN_PEERS_DIR`` (a relative path is taken from the repository root), else ``<repo>/.peers``."""
    d = os.environ.get("MEGATRAIN_PEERS_DIR") or ".peers"
    return d if os.path.isabs(d) else os.path.join(ROOT, d)


def source_dir(name: str) -> str:
    """Where peer ``name``'s source tree is expected: ``peers_dir()/name``."""
    return os.path.join(peers_dir(), name)


def source_info(name: str) -> dict:
    """The peer's repository and, where the tree carries a ``.source`` file (``<repo> <commit>``), its commit."""
    info = dict(repo=PEER_REPOS[name], path=source_dir(name), commit=None)
    try:
        with open(os.path.join(source_dir(name), ".source")) as f:
            parts = f.read().split()
        if len(parts) >= 2:
            info.update(repo=parts[0], commit=parts[1])
    except OSError:
        pass
    return info


def skip_reason(name: str, spec: dict | None = None) -> str | None:
    """A row status ``"skipped: ..."`` when peer ``name`` cannot run ``spec`` here, else None.

    Checked in the parent before a child is spawned (and again in the child): the source tree is
    missing, or the spec asks for something the peer does not have (SlideFormer: gradient accumulation).
    """
    marker = os.path.join(source_dir(name), PEER_MARKERS[name])
    if not os.path.isfile(marker):
        return (f"skipped: {name} source not found ({marker} missing): put a checkout of {PEER_REPOS[name]} "
                f"at {source_dir(name)} or set MEGATRAIN_PEERS_DIR")
    if spec is not None:
        mod = importlib.import_module(f"peers.{name}")
        reason = getattr(mod, "unsupported", lambda s: None)(spec)
        if reason:
            return f"skipped: {reason}"
    return None


def run(spec: dict, bench) -> dict:
    """Run peer ``spec["system"]`` in this (child) process; ``bench`` is the bench_train module
    (``build_model``, ``make_batches``, ``timed_loop``, ``clip_and_accum``, ``OPT``). Returns a partial
    row (timings from ``timed_loop``, ``n_params``, ``settings``, ``precision``, ``clips``, ...) or
    ``{"status": "skipped: ..."}``."""
    name = spec["system"]
    reason = skip_reason(name, spec)
    if reason:
        return dict(status=reason, peer_source=source_info(name))
    mod = importlib.import_module(f"peers.{name}")
    row = mod.run(spec, bench, source_dir(name))
    row["peer_source"] = source_info(name)
    return row
