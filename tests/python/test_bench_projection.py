"""benchmarks/bench_projection.py: a few layers measured, the whole model's step projected (CPU, tiny shape)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_projection  # noqa: E402
import bench_train  # noqa: E402


def test_projection_is_linear_in_depth():
    p = bench_projection.projection({1: 1.5, 4: 3.0}, 108)
    assert p["per_layer_s"] == pytest.approx(0.5) and p["head_part_s"] == pytest.approx(1.0)
    assert p["step_s"] == pytest.approx(1.0 + 108 * 0.5)
    with pytest.raises(ValueError, match="two depths"):
        bench_projection.projection({4: 3.0}, 108)


@pytest.mark.parametrize("argv, msg", [(["--measure-layers", "1"], "need 1 <= --base-layers < --measure-layers"),
                                       (["--measure-layers", "200"], "got 1, 200, 108"),
                                       (["--base-layers", "0"], "got 0, 4, 108"),
                                       (["--steps", "0"], "need --steps >= 1")])
def test_bad_depths_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit):
        bench_projection.parse_args(argv)
    assert msg in capsys.readouterr().err


def test_paper_preset_estimates_the_whole_model_on_the_assumed_machine():
    """No GPU needed: the ~120B shape read on the meta device, judged on 1.5 TiB + one 141 GB H200."""
    args = bench_projection.parse_args([])
    assert args.shape == dict(hidden=10240, layers=108, inter=28672, vocab=32000, heads=80, kv_heads=8)
    assert (args.batch, args.seq, args.max_grad_norm) == (4, 4096, 1.0)
    est = bench_projection.full_estimate(args.shape, "cuda", args.batch, args.seq, args.max_grad_norm,
                                         args.host_memory, args.gpu_memory)
    assert est.num_params == bench_train.llama_params(args.shape)
    assert est.to_dict()["assumed_machine"] == {"host": "1.50 TiB (given)", "gpu": "131.32 GiB (given)"}
    policy = bench_projection.chosen_policy(est)  # what auto picks for 108 layers in 131 GiB
    assert est.compute_dtype == "bfloat16" and est.activation_policy == f"auto ({policy})"


def test_tiny_runs_on_cpu_and_writes_the_projection(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_projection.py"), "--preset", "tiny",
                        "--device", "cpu", "--steps", "1", "--warmup", "1", "--seq", "32", "--layers", "6",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "bench_projection" and doc["measured_layers"] == [1, 4]
    assert doc["shape"]["layers"] == 6 and doc["batch"] == 2 and doc["seq"] == 32 and doc["max_grad_norm"] == 1.0
    assert {"git_commit", "date", "machine", "versions"} <= set(doc)
    m1, m4 = doc["measured"]
    assert (m1["layers"], m4["layers"]) == (1, 4) and m1["step_s"] > 0 and len(m4["step_times_s"]) == 1
    p = doc["projection"]
    expect = bench_projection.projection({1: m1["step_s"], 4: m4["step_s"]}, 6)
    assert p["step_s"] == pytest.approx(expect["step_s"]) and p["n_params"] == bench_train.llama_params(doc["shape"])
    flops = bench_train.model_flops_per_step(p["n_params"], doc["shape"], 2, 32)
    assert p["model_tflops"] == pytest.approx(flops / p["step_s"] / 1e12)
    est = doc["estimate"]
    assert est["num_params"] == p["n_params"] and est["num_layers"] == 6 and est["host_bytes"] > 0
    assert est["assumed_machine"]["host"] == "this machine" and "megatrain estimate" in est["table"]
    assert "projected 6 layers" in r.stdout
