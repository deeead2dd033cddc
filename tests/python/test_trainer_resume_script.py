"""benchmarks/trainer_resume.py --tiny: the H200 Trainer save/resume script runs end to end on the CPU.

The script trains (process A), resumes from A's middle checkpoint (process B) and compares; on the
CPU with fp32 the resumed run must equal the uninterrupted one bit for bit (the script exits 1
otherwise). About 30-40 s on 2 cores, most of it three Python start-ups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "trainer_resume.py")


def test_trainer_resume_script_tiny_cpu_bit_identical(tmp_path):
    out = tmp_path / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.path.join(REPO, "python") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, SCRIPT, "--tiny", "--workdir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"{p.stdout[-4000:]}\n{p.stderr[-6000:]}"
    r = json.loads(out.read_text())
    n = r["config"]["steps"]
    half = n // 2
    assert r["config"]["device"] == "cpu" and r["config"]["compute_dtype"] == "fp32"
    assert r["steps_compared"] == list(range(half + 1, n + 1))
    assert r["bit_identical"] is True
    assert r["losses_A"] == r["losses_B_resumed"] and None not in r["losses_A"]
    assert r["step_loss_diff"]["max_abs"] == 0.0 and r["micro_batch_loss_diff"]["bit_identical"]
    assert r["micro_batch_loss_diff"]["n"] == half * r["config"]["grad_accum"]
    d = r["final_params_diff"]
    assert d["keys_match"] and d["tensors"] == d["tensors_equal"] > 0 and d["max_abs"] == 0.0
    assert r["losses_A_all_steps"][-1] < r["losses_A_all_steps"][0]  # learnable data: the loss falls
    # Checkpoint, resume and save_model figures are there.
    c = r["checkpoint"]
    assert c["step"] == half and c["bytes_megatrain_state"] > 0 and c["bytes_hf_model"] > 0 and c["save_s"] > 0
    assert "megatrain" in c["files"] and "trainer_state.json" in c["files"] and "optimizer.pt" not in c["files"]
    assert r["resume"]["megatrain_load_s"] is not None
    chk = r["save_model"]["from_pretrained_check"]
    assert chk["params_match"] and chk["params"] == r["params"] and chk["class"] == "LlamaForCausalLM"
    for role, steps in (("A", n), ("B", half)):
        proc = r["processes"][role]
        assert proc["steps_run"] == steps
        assert proc["peak_rss_gib"] > 0
        assert proc["figures"]["megatrain/tokens_per_s"] > 0 and proc["figures"]["megatrain/host_store_gib"] > 0
    assert len(r["log_history_B"]) >= half
    # The work directory (checkpoints, saved models) is removed unless --keep.
    assert not os.path.exists(tmp_path / "work" / "A")
