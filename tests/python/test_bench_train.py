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


# ---- peers run from their own public source (benchmarks/peers/) ----

def test_peers_are_named_systems_but_not_in_the_default_list():
    assert set(bench_train.PEER_SYSTEMS) == {"megatrain_official", "slideformer"}
    assert not set(bench_train.PEER_SYSTEMS) & set(bench_train.DEFAULT_SYSTEMS)
    for name in bench_train.PEER_SYSTEMS:
        assert bench_train.system_name(name) == name


def test_peer_rows_are_skipped_when_their_source_is_missing(tmp_path):
    out = tmp_path / "peers.json"
    env = dict(os.environ, MEGATRAIN_PEERS_DIR=str(tmp_path / "no_peers"),
               PYTHONPATH=os.path.join(ROOT, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_train.py"), "--preset", "tiny",
                        "--device", "cpu", "--systems", "megatrain_official", "slideformer", "--steps", "1",
                        "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["system"] for row in rows] == ["megatrain_official", "slideformer"]
    for row in rows:
        assert row["status"].startswith(f"skipped: {row['system']} source not found (")
        assert str(tmp_path / "no_peers" / row["system"]) in row["status"]
    assert "==== " not in r.stderr  # decided in the parent: no child was started


def test_peer_adapters_import_without_a_gpu_and_say_what_they_cannot_run():
    import peers.megatrain_official as mo
    import peers.slideformer as sf
    assert mo.unsupported(dict(device="cuda", grad_accum=4)) is None
    assert "needs CUDA" in mo.unsupported(dict(device="cpu"))
    assert sf.unsupported(dict(device="cuda", grad_accum=1)) is None
    assert "no gradient accumulation (grad_accum=2)" in sf.unsupported(dict(device="cuda", grad_accum=2))


def test_a_peer_size_beyond_the_hosts_memory_is_a_skipped_row_not_a_run(monkeypatch):
    """Projected from the 3.37B host peaks: on a 125.8 GiB host the official code runs the 7b preset but not 8b
    (~127 GiB), SlideFormer both; the parent says so in the row's status before spawning a child."""
    import peers
    from megatrain.runtime.placement import host_memory

    avail = int(125.8 * 2**30)
    n = {p: bench_train.llama_params(bench_train.PRESETS[p]) for p in ("3b", "7b", "8b")}
    assert peers.host_skip_reason("megatrain_official", n["7b"], avail) is None
    assert peers.host_skip_reason("slideformer", n["8b"], avail) is None
    msg = peers.host_skip_reason("megatrain_official", n["8b"], avail)
    assert msg.startswith("skipped: megatrain_official would need ~127 GiB of host memory (16.1 B/param") and "126 GiB" in msg
    assert peers.host_skip_reason("slideformer", n["8b"], None) is None  # unknown memory: not skipped
    monkeypatch.setattr(peers, "skip_reason", lambda name, spec: None)  # as if the source tree were there
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: {"mem_available_bytes": avail})
    spec = dict(system="megatrain_official", model=bench_train.PRESETS["8b"], device="cuda")
    assert bench_train.peer_skip_reason(spec) == msg
    assert bench_train.peer_skip_reason(dict(spec, model=bench_train.PRESETS["3b"])) is None



def test_fsdp2_offload_beyond_the_hosts_memory_is_skipped_before_it_builds_anything(monkeypatch):
    """FSDP2 CPU offload keeps 16 B/param of fp32 state on the host: on a 120 GiB host 8.47B (126 GiB) is a
    skipped row with both numbers, returned before the process group or the model exist; 6.74B is not refused."""
    from megatrain.runtime.placement import host_memory

    avail = 120 * 2**30
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: {"mem_available_bytes": avail})
    built = []
    monkeypatch.setattr(bench_train, "_init_single_rank_pg", lambda *a: built.append("pg") or 1 / 0)
    monkeypatch.setattr(bench_train, "build_model", lambda *a: built.append("model") or 1 / 0)
    monkeypatch.setattr("torch.cuda.set_device", lambda *a: None)
    row = bench_train.run_fsdp2(dict(system="fsdp2_offload", model=bench_train.PRESETS["8b"], seq=4096, device="cuda"))
    assert row["status"] == ("skipped: FSDP2 CPU offload keeps 16 B/param of fp32 state on the host, 126.2 GiB; "
                             "120.0 GiB available") and built == []
    with pytest.raises(ZeroDivisionError):  # 6.74B (100.4 GiB) goes on to build
        bench_train.run_fsdp2(dict(system="fsdp2_offload", model=bench_train.PRESETS["7b"], seq=4096, device="cuda"))
    assert built == ["pg"]

_STUB_INFINITY = '''
import torch
class CPUMasterConfig:
    def __init__(self, dataset_name="", dtype=torch.bfloat16, checkpoint_interval=4, num_grad_slabs=12, **kw):
        assert dataset_name, "the real config raises without a dataset"
        self.__dict__.update(kw, dataset_name=dataset_name, dtype=dtype, checkpoint_interval=checkpoint_interval,
                             num_grad_slabs=num_grad_slabs)
class CPUMasterModel:
    calls = []
    def __init__(self, hf_model, config):
        self.model, self.config = hf_model, config
    def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
        return {"attention_mask": mask, "use_cache": False, "output_attentions": False}
    def forward_and_backward(self, input_ids, attention_mask, labels):
        kw = self._build_layer_kwargs(attention_mask, None, None, None)
        CPUMasterModel.calls.append(("fb", kw["attention_mask"], input_ids.device.type))
        loss = self.model(input_ids=input_ids, labels=labels, attention_mask=kw["attention_mask"]).loss
        loss.backward()
        return loss.item(), input_ids.numel(), {}
    def get_parameters(self):
        return list(self.model.parameters())
    def _sync_params_to_gpu(self):
        CPUMasterModel.calls.append(("sync",))
    def zero_grad(self):
        for p in self.get_parameters():
            if p.grad is not None:
                p.grad.zero_()
    def cleanup(self):
        CPUMasterModel.calls.append(("cleanup",))
'''


def test_megatrain_official_adapter_drives_the_trainer_sequence(tmp_path, monkeypatch):
    """The adapter on a CPU stand-in of infinity's API: micro-batches per step, clipping, bf16 parameters,
    the attention-mask shim and the row fields (the real CPUMasterModel needs CUDA)."""
    import torch
    import peers
    import peers.megatrain_official  # noqa: F401  (peers imports its adapters lazily)
    src = tmp_path / "megatrain_official"
    (src / "infinity" / "model").mkdir(parents=True)
    (src / "infinity" / "model" / "cpu_master.py").write_text("")
    (src / "infinity" / "__init__.py").write_text(_STUB_INFINITY)
    (src / ".source").write_text("github.com/DLYuanGod/MegaTrain 919520f07182c0d4d3e9765b2f915702e71c11a4\n")
    monkeypatch.setenv("MEGATRAIN_PEERS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(peers.megatrain_official, "unsupported", lambda spec: None)  # the stand-in runs on CPU
    monkeypatch.delitem(sys.modules, "infinity", raising=False)
    spec = dict(system="megatrain_official", device="cpu", model=dict(bench_train.PRESETS["tiny"], layers=2),
                batch=1, seq=16, steps=2, warmup=1, seed=0, max_grad_norm=1.0, grad_accum=2)
    try:
        row = peers.run(spec, bench_train)
        infinity = sys.modules["infinity"]
    finally:
        sys.modules.pop("infinity", None)
        sys.path.remove(str(src))
    calls = infinity.CPUMasterModel.calls
    assert [c[0] for c in calls] == ["fb", "fb", "sync"] * 3 + ["cleanup"]
    assert all(c[1] is None and c[2] == "cpu" for c in calls if c[0] == "fb")
    assert row["precision"] == "bf16" and row["clips"] is True and "train.py:268" in row["clip_support"]
    assert row["peer_source"]["commit"].startswith("919520f")
    assert row["n_params"] == bench_train.llama_params(spec["model"]) and row["step_s"] > 0
    assert len(row["step_times_s"]) == 2 and row["settings"]["grad_accum"] == 2
    assert row["settings"]["optimizer"].startswith(("torch.optim.AdamW", "DeepSpeedCPUAdam"))


@pytest.mark.skipif(not os.path.isfile(os.path.join(
    os.environ.get("MEGATRAIN_PEERS_DIR") or os.path.join(ROOT, ".peers"), "megatrain_official", "infinity", "__init__.py")),
    reason="the official MegaTrain source is not checked out under $MEGATRAIN_PEERS_DIR")
def test_megatrain_official_source_has_the_api_the_adapter_calls(monkeypatch):
    import inspect
    import peers
    src = peers.source_dir("megatrain_official")
    monkeypatch.syspath_prepend(src)
    monkeypatch.delitem(sys.modules, "infinity", raising=False)
    from infinity import CPUMasterConfig, CPUMasterModel
    assert list(inspect.signature(CPUMasterModel._build_layer_kwargs).parameters) == \
        ["self", "mask", "cache_position", "position_ids", "position_embeddings"]
    assert list(inspect.signature(CPUMasterModel.forward_and_backward).parameters)[:4] == \
        ["self", "input_ids", "attention_mask", "labels"]
    for m in ("get_parameters", "_sync_params_to_gpu", "zero_grad", "cleanup"):
        assert callable(getattr(CPUMasterModel, m))
    fields = set(inspect.signature(CPUMasterConfig).parameters)
    assert {"device", "dtype", "attn_implementation", "dataset_name", "max_grad_norm", "beta1", "beta2", "eps",
            "gradient_accumulation_steps", "learning_rate", "weight_decay"} <= fields
    sys.modules.pop("infinity", None)


def test_default_and_liger_variants_parse_and_bad_ones_are_refused():
    assert bench_train.megatrain_variant("megatrain:policy=default") == {"policy": "default"}
    assert bench_train.megatrain_variant("megatrain:policy=default,liger=0") == {"policy": "default", "liger": "0"}
    with pytest.raises(ValueError, match="liger is 0 or 1"):
        bench_train.megatrain_variant("megatrain:liger=yes")
    assert bench_train.megatrain_variant("megatrain:policy=default,hcc=0") == {"policy": "default", "hcc": "0"}
    with pytest.raises(ValueError, match="hcc is 0 or 1"):
        bench_train.megatrain_variant("megatrain:hcc=auto")
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


def test_ratios_compare_with_a_megatrain_variant_never_with_the_official_peer():
    rows = [dict(system="megatrain_official", status="ok", tokens_per_s=1000.0, gpu_peak_gib=5.0),
            dict(system="torch_ckpt", status="ok", tokens_per_s=2000.0, gpu_peak_gib=50.0),
            dict(system="megatrain:policy=default", status="ok", tokens_per_s=4000.0, gpu_peak_gib=100.0)]
    got = {r["peer"]: r for r in bench_train.ratios(rows)}
    assert {r["megatrain"] for r in got.values()} == {"megatrain:policy=default"}
    assert got["megatrain_official"]["throughput_ratio"] == 4.0 and got["torch_ckpt"]["throughput_ratio"] == 2.0


def test_before_after_sizes_gathers_one_row_per_size_keeps_a_failed_run_and_refuses_a_missing_one(tmp_path, capsys):
    import before_after_sizes as bas

    def write(preset, tree, step_s, status="ok"):
        row = dict(system="megatrain:policy=auto", status=status, step_s=step_s, n_params=3e9 if preset == "3b" else 7e9,
                   layers=28, tokens_per_step=16384, max_grad_norm=1.0, model_tflops=100.0 / step_s if step_s else None,
                   gpu_peak_gib=10.0, host_peak_gib=50.0)
        doc = dict(git_commit=tree[:3], date="2026-12-05T00:00:00", gpu="H200", rows=[row])
        (tmp_path / f"before_after_{preset}_megatrain_policy_auto_{tree}_clip1.0_h200.json").write_text(json.dumps(doc))

    for preset, b, a in (("3b", 1.0, 0.8), ("7b", 2.0, 2.2)):
        write(preset, "before", b)
        write(preset, "after", a)
    out = tmp_path / "sizes.json"
    bas.main(["--presets", "3b", "7b", "--dir", str(tmp_path), "--suffix", "_h200", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["before_step_s"], r["after_step_s"]) for r in rows] == [("3b", 1.0, 0.8), ("7b", 2.0, 2.2)]
    assert rows[0]["after_over_before"] == pytest.approx(0.8) and rows[1]["after_over_before"] == pytest.approx(1.1)
    assert (tmp_path / "sizes.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="8b.*missing"):
        bas.main(["--presets", "3b", "8b", "--dir", str(tmp_path), "--suffix", "_h200", "--out", str(out)])
    # run_h200.sh's stage: files named without a preset (BA_PRESET unset), the table printed, nothing written
    for tree, t in (("before", 1.0), ("after", 0.9)):
        doc = json.loads((tmp_path / f"before_after_3b_megatrain_policy_auto_{tree}_clip1.0_h200.json").read_text())
        doc["rows"][0]["step_s"] = t
        (tmp_path / f"before_after_megatrain_policy_auto_{tree}_clip1.0_h200.json").write_text(json.dumps(doc))
    out.unlink()
    bas.main(["--presets", "", "--dir", str(tmp_path), "--suffix", "_h200"])
    assert "| 1.000 | 0.900 | 0.900 |" in capsys.readouterr().out and not out.exists()
    write("7b", "before", None, status="oom")
    bas.main(["--presets", "7b", "--dir", str(tmp_path), "--suffix", "_h200", "--out", str(out)])
    (r,) = json.loads(out.read_text())["rows"]
    assert (r["before_status"], r["before_step_s"], r["after_step_s"], r["after_over_before"]) == ("oom", None, 2.2, None)


def test_slideformer_mask_shim_drops_cache_position_and_builds_transformers_own_mask(monkeypatch):
    """SlideFormer passes cache_position to create_causal_mask; on a transformers without it the shim drops it
    and the mask equals transformers' own (a padded batch: a mask that is not just is_causal)."""
    import inspect

    import torch
    import transformers
    from transformers import masking_utils

    import peers.slideformer as sf
    orig = masking_utils.create_causal_mask
    monkeypatch.setattr(masking_utils, "create_causal_mask", orig)  # restored after the test
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    x = torch.zeros(2, 6, 32)
    am = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    pos = torch.arange(6).expand(2, 6)
    kw = dict(config=cfg, inputs_embeds=x, attention_mask=am, position_ids=pos, past_key_values=None)
    if "cache" in inspect.signature(orig).parameters:
        want = orig(cache=None, **{k: v for k, v in kw.items() if k != "past_key_values"})
    else:
        want = orig(cache_position=torch.arange(6), **kw)
    done = sf.mask_shim()
    got = masking_utils.create_causal_mask(cache_position=torch.arange(6), **kw)  # SlideFormer's call
    assert got is not None and torch.equal(got, want)
    if "cache_position" in inspect.signature(orig).parameters:
        assert done == "none needed" and masking_utils.create_causal_mask is orig
    else:
        assert "without cache_position" in done and sf.mask_shim() == "none needed"  # installed once
