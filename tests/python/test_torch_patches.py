"""Importing megatrain leaves torch as it is; the first ``wrap`` installs megatrain's reroutes, once."""

import json
import os
import subprocess
import sys
from pathlib import Path

# (module, attribute) of every torch function megatrain reroutes (runtime/compat/torch_patches.py).
PATCHED = [
    ("torch.nn.utils", "clip_grad_norm_"),
    ("torch.nn.utils.clip_grad", "clip_grad_norm_"),
    ("torch.nn.utils", "clip_grad_value_"),
    ("torch.nn.utils.clip_grad", "clip_grad_value_"),
    ("torch.autograd", "grad"),
    ("torch.autograd", "backward"),
    ("torch.nn.utils._named_member_accessor", "swap_tensor"),
    ("torch.nn.utils._named_member_accessor", "set_tensor"),
    ("torch.nn.utils.parametrize", "register_parametrization"),
]

_SCRIPT = r"""
import importlib, json, sys
import torch
import torch.nn.utils.clip_grad, torch.nn.utils._named_member_accessor, torch.nn.utils.parametrize
import transformers

PATCHED = json.loads(sys.argv[1])
def now():
    return [getattr(importlib.import_module(m), a) for m, a in PATCHED]

plain = now()
import megatrain, megatrain.cli, megatrain.integrations.hf_trainer, megatrain.train.config  # noqa: E401
after_import = now()
cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64)
torch.manual_seed(0)
megatrain.wrap(transformers.AutoModelForCausalLM.from_config(cfg), device="cpu", compute_dtype=torch.float32)
after_wrap = now()
torch.manual_seed(0)
megatrain.wrap(transformers.AutoModelForCausalLM.from_config(cfg), device="cpu", compute_dtype=torch.float32)
after_second = now()
print(json.dumps({
    "unchanged_at_import": [a is b for a, b in zip(plain, after_import)],
    "replaced_at_wrap": [a is not b for a, b in zip(plain, after_wrap)],
    "wrap_modules": [getattr(f, "__module__", "") for f in after_wrap],
    "same_after_second_wrap": [a is b for a, b in zip(after_wrap, after_second)],
}))
"""


def test_import_leaves_torch_alone_and_the_first_wrap_installs_the_reroutes():
    python_dir = Path(__file__).resolve().parents[2] / "python"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(python_dir), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(PATCHED)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [f"{m}.{a}" for m, a in PATCHED]
    changed = [n for n, same in zip(names, got["unchanged_at_import"]) if not same]
    assert not changed, f"import megatrain replaced torch functions: {changed}"
    missing = [n for n, rep in zip(names, got["replaced_at_wrap"]) if not rep]
    assert not missing, f"megatrain.wrap did not install: {missing}"
    assert all(m.startswith("megatrain.runtime.") for m in got["wrap_modules"]), got["wrap_modules"]
    assert all(got["same_after_second_wrap"]), "a second wrap replaced the installed functions again"
