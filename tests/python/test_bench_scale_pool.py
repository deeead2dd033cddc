"""``benchmarks/bench_scale.py pool`` on the CPU: the largest-model benchmark end to end (tiny shape, a host limit
that makes one layer exclusive), and its search over the layer count with ``megatrain.estimate`` alone."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_scale_pool  # noqa: E402
from bench_train import model_flops_per_step  # noqa: E402


def test_pool_benchmark_runs_end_to_end_small(tmp_path):
    """``bench_scale.py pool --small``: the layer count and the estimate printed before the child builds, one
    exclusive layer, the row's measurements and the prediction beside them."""
    out = tmp_path / "pool.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "pool", "--small",
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.index("megatrain estimate:") < r.stdout.index("status ok")
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert row["status"] == "ok" and row["layers"] == 4 and len(row["step_times_s"]) == 2
    pl = row["placement"]
    assert pl["exclusive_layers"] == [0] and pl["exclusive_share"] == "auto" and pl["host_store_bytes"] > 0
    settings = result["settings"]
    assert pl["activation_reserve"] == f"batch {settings['batch']} x {settings['seq']}"  # from_config got the batch
    assert row["host_stored_params"] + row["exclusive_params"] == row["n_params"] and row["exclusive_params"] > 0
    assert row["host_store_bytes_per_host_param"] == pl["host_store_bytes"] / row["host_stored_params"]
    m = result["model"]
    flops = model_flops_per_step(row["n_params"], m, result["settings"]["batch"], result["settings"]["seq"])
    assert abs(row["model_tflops"] - flops / row["step_s"] / 1e12) <= 1e-9 * row["model_tflops"]
    assert row["peak_rss_gib"] > 0 and row["gpu_peak_gib"] is None
    # the estimate beside the measurement: its host bytes with every section in the host store, one byte over
    assert row["predicted"]["host_bytes"] == result["settings"]["host_limit"] + 1


def test_the_search_finds_the_largest_layer_count_the_estimate_says_fits(monkeypatch):
    """Doubling then bisection over N, with the estimate's verdict as the only oracle."""
    calls = []

    def fits(n, spec):
        calls.append(n)
        return n <= spec["limit"]

    monkeypatch.setattr(bench_scale_pool, "_fits", fits)
    for limit in (0, 1, 37, 48, 64, 511):
        calls.clear()
        assert bench_scale_pool.largest_layers(dict(limit=limit)) == limit
        assert len(calls) <= 2 * 10
