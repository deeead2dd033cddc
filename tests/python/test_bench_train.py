"""The end-to-end benchmark harness (benchmarks/bench_train.py) on CPU: size sweep bookkeeping."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_train  # noqa: E402


def test_llama_params_matches_the_models_it_describes():
    # 1b is TinyLlama's shape: 1,100,048,384 parameters as loaded by from_pretrained on the H200.
    assert bench_train.llama_params(bench_train.SIZE_SHAPES["1b"]) == 1_100_048_384
    from transformers import LlamaConfig, LlamaForCausalLM
    m = bench_train.SIZE_SHAPES["tiny"]
    cfg = LlamaConfig(hidden_size=m["hidden"], num_hidden_layers=m["layers"], intermediate_size=m["inter"],
                      vocab_size=m["vocab"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                      tie_word_embeddings=False)
    assert bench_train.llama_params(m) == sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())


@pytest.mark.skipif((bench_train.machine_info()["host_mem_gib"] or 0) > 250,
                    reason="13b would fit in this host's memory and run on the CPU")
def test_size_sweep_runs_what_fits_and_records_what_does_not(tmp_path):
    out = tmp_path / "size.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--sweep", "size",
                        "--sizes", "tiny", "13b", "--device", "cpu", "--systems", "megatrain", "--steps", "1",
                        "--warmup", "1", "--batch", "2", "--seq", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["size"] for row in rows] == ["tiny", "13b"]
    assert rows[0]["status"] == "ok" and rows[0]["n_params"] == bench_train.llama_params(bench_train.SIZE_SHAPES["tiny"])
    assert rows[0]["step_s"] > 0 and rows[0]["tokens_per_step"] == 64
    assert rows[1]["status"].startswith("skipped: needs ~267 GiB of host memory (13.02B params)")
    assert (tmp_path / "size.png").stat().st_size > 0


def test_megatrain_variant_options_parse_and_bad_ones_are_refused():
    assert bench_train.megatrain_variant("megatrain") == {}
    assert bench_train.megatrain_variant("megatrain:slots=1,d2h=0,policy=store") == \
        {"slots": "1", "d2h": "0", "policy": "store"}
    with pytest.raises(ValueError, match="bad megatrain variant option"):
        bench_train.megatrain_variant("megatrain:prefetch=2")
    with pytest.raises(ValueError, match="bad megatrain variant option"):
        bench_train.megatrain_variant("megatrain:slots")
    assert bench_train.megatrain_variant("megatrain:fusednorm=0,cslots=0") == {"fusednorm": "0", "cslots": "0"}
    assert bench_train.megatrain_variant("megatrain:devstate=14") == {"devstate": "14"}
    assert bench_train.megatrain_variant("megatrain:devstate=auto") == {"devstate": "auto"}
    assert bench_train.megatrain_variant("megatrain:lean=0,policy=auto") == {"lean": "0", "policy": "auto"}
    with pytest.raises(ValueError, match="devstate is a layer count"):
        bench_train.megatrain_variant("megatrain:devstate=all")


def test_clipping_and_accumulation_reach_every_cpu_system(tmp_path):
    # --max-grad-norm and --grad-accum reach megatrain and torch alike (the rows and settings record them;
    # same seeded init and micro-batches, fp32 on the CPU: the last losses agree). Clipping's own
    # exactness is tested in test_parity_cpu.py; Adam is nearly invariant to it over a few steps.
    out = tmp_path / "clip.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--preset", "tiny",
                        "--device", "cpu", "--systems", "megatrain", "torch_nockpt", "--steps", "2", "--warmup", "1",
                        "--batch", "1", "--seq", "16", "--layers", "2", "--max-grad-norm", "0.05", "--grad-accum", "2", "--lr", "0.01",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["status"] for row in rows] == ["ok", "ok"]
    for row in rows:
        assert row["grad_accum"] == 2 and row["max_grad_norm"] == 0.05 and row["tokens_per_step"] == 32
        assert row["settings"]["max_grad_norm"] == 0.05 and row["settings"]["grad_accum"] == 2
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-6 * abs(rows[1]["loss"])


def test_disk_train_benchmark_runs_end_to_end_small(tmp_path):
    """``bench_scale.py disk --small``: the plan, the disk's bandwidth, some layers on disk, both token counts."""
    out = tmp_path / "disk_train.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "disk", "--small",
                        "--dir", str(tmp_path / "d"), "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.index("planned:") < r.stderr.index("==== disk_small")  # the plan before anything is built
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "ok" and row["disk_layers"] == [3, 4, 5]
    for t in row["per_tokens"]:
        assert t["disk_read_bytes_per_step"] > 0 and t["disk_write_bytes_per_step"] == row["disk_state_bytes"]
        assert 0.0 <= t["io_hidden_fraction"] <= 1.0 and t["disk_floor_s"] > 0
    assert not (tmp_path / "d" / "megatrain_tier").exists() or not os.listdir(tmp_path / "d" / "megatrain_tier")


def test_default_and_liger_variants_parse_and_bad_ones_are_refused():
    assert bench_train.megatrain_variant("megatrain:policy=default") == {"policy": "default"}
    assert bench_train.megatrain_variant("megatrain:policy=default,liger=0") == {"policy": "default", "liger": "0"}
    with pytest.raises(ValueError, match="liger is 0 or 1"):
        bench_train.megatrain_variant("megatrain:liger=yes")
    assert bench_train.torch_variant("torch_ckpt:liger=1") == {"liger": "1"}
    assert bench_train.system_name("torch_nockpt:liger=1") == "torch_nockpt:liger=1"
    with pytest.raises(ValueError, match="use liger=0|1"):
        bench_train.torch_variant("torch_ckpt:liger=2")


def test_megatrain_with_defaults_passes_no_option_to_wrap(tmp_path):
    """``megatrain:policy=default`` is ``megatrain.wrap(model)`` as a user gets it (on the CPU: recompute),
    and the ratios are taken against it when no plain ``megatrain`` row ran."""
    out = tmp_path / "d.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--preset", "tiny",
                        "--device", "cpu", "--systems", "megatrain:policy=default", "torch_ckpt", "--steps", "1",
                        "--warmup", "1", "--batch", "2", "--seq", "32", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    mt = d["rows"][0]
    assert mt["status"] == "ok" and mt["settings"]["wrap_kwargs"] == {}
    assert mt["settings"]["activation_policy"] == "recompute" and mt["settings"]["liger_kernel"] is None
    assert mt["settings"]["grad_accumulator"] is None  # wrap's default, not the harness's True
    assert [x["megatrain"] for x in d["ratios"]] == ["megatrain:policy=default"]
    assert [x["peer"] for x in d["ratios"]] == ["torch_ckpt"]
