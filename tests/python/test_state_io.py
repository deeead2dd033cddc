"""megatrain.state: one safetensors writer (bytes pinned to the format written before it was shared),
one dtype table, and the engine reached only through runtime.engine.state_access.StateAccess."""

import hashlib
import re
from pathlib import Path

import torch

STATE_DIR = Path(__file__).resolve().parents[2] / "python" / "megatrain" / "state"


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_save_pretrained_shards_keep_their_bytes(tmp_path):
    from megatrain.state.save_pretrained import stream_safetensors

    t = {"b.w": torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7, "a.h": (torch.arange(7) / 3).to(torch.bfloat16),
         "i": torch.arange(5), "m": torch.tensor([True, False]),
         "z": (torch.arange(6, dtype=torch.float32).reshape(2, 3) / 9).t()}  # not contiguous
    stream_safetensors(t, str(tmp_path / "s"), {"format": "pt"})
    assert _sha(tmp_path / "s") == "62bac390dc440efb27ed974dadffd54b0a9e75512a0ea4fa7583881a28b91fd0"


def test_checkpoint_unit_files_keep_their_bytes(tmp_path):
    from megatrain.state.safetensors_file import DeferredTensor, write_fp32_safetensors

    fp = [("master.x", torch.arange(12, dtype=torch.float32).reshape(3, 4) / 11),
          ("exp_avg.x", DeferredTensor((3, 4), torch.float32, lambda: torch.zeros(3, 4))), ("e", torch.zeros(0))]
    for dtype, sha, n in ((torch.float32, "a5abb0ae86b6afaecc1f6c760026c37e964b1c021bc9554a8fa9359b5aba9a79", 344),
                          (torch.bfloat16, "10f0dd83bf80aa88cf44904a5b8510df81462e6adfd90bed162baa4e2c04b64b", 296)):
        out = write_fp32_safetensors(str(tmp_path / "c"), fp, {"format": "pt", "megatrain_unit": 3}, dtype=dtype,
                                     sync=False)
        assert out == {"sha256": sha, "bytes": n} and _sha(tmp_path / "c") == sha


def test_one_dtype_table():
    from megatrain.state import safetensors_file, safetensors_index

    assert safetensors_index.CODE_DTYPES is safetensors_file.CODE_DTYPES
    tables = [p.name for p in STATE_DIR.rglob("*.py") if re.search(r'torch\.float32: "F32"|"F32": torch', p.read_text())]
    assert tables == ["safetensors_file.py"]


def test_state_reaches_the_engine_only_through_state_access():
    engine_calls = re.compile(r"\beng\.|\.entry_view\(|\.state_window\(|\.sync_host\(|\.host_written\(|\.invalidate\(|"
                              r"\blocate\(|\.megatrain\.")
    found = [f"{p.relative_to(STATE_DIR)}:{i}" for p in STATE_DIR.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if engine_calls.search(line)]
    assert found == []
