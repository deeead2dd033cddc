"""The RNG states a checkpoint saves and restores: Python, NumPy, torch CPU and CUDA."""

from __future__ import annotations

import random

import torch


def jsonable(v):
    """``v`` with tensors turned into numbers / lists (recursively through lists and tuples)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def rng_state() -> dict:
    """The RNG states as JSON-able lists (CUDA only when initialised)."""
    st = {"python": jsonable(list(random.getstate())), "torch": torch.get_rng_state().tolist()}
    try:
        import numpy as np
        s = np.random.get_state()
        st["numpy"] = [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [t.tolist() for t in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: dict) -> None:
    """Restore what :func:`rng_state` returned (CUDA only with the same device count)."""
    v, state, gauss = st["python"]
    random.setstate((v, tuple(state), gauss))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "numpy" in st:
        try:
            import numpy as np
            name, keys, pos, has_gauss, cached = st["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in st and torch.cuda.is_available():
        states = [torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
