"""Data parallel (torch.distributed, gloo on the CPU): N ranks x micro-batch b against 1 rank x N*b.

Each test starts its ranks as subprocesses (``dp_rank.py``; RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE as torchrun sets them), sharing one host store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import megatrain
from parity import PARITY_EPS, assert_close_rel, make_batches, tiny_llama_config

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dp_rank.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out_dir, world, args, local_world=None, env_extra=None):
    """Start ``world`` ranks of dp_rank.py; returns the list of Popen (not waited for)."""
    local_world = local_world or world
    port = _port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r % local_world), LOCAL_WORLD_SIZE=str(local_world), OMP_NUM_THREADS="1",
                   MEGATRAIN_ADAM_THREADS="1", **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, str(out_dir), json.dumps(args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def run_ranks(out_dir, world, args, local_world=None, timeout=150, env_extra=None):
    procs = launch(out_dir, world, args, local_world, env_extra)
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out[-3000:]}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def reference(args, world, device="cpu", compute_dtype=torch.float32):
    """1 rank x (world * b): the same global batch, no process group."""
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(tied=args.get("tied", False))
    torch.manual_seed(args.get("seed", 0))
    model = LlamaForCausalLM(cfg).float()
    for n, p in model.named_parameters():
        if any(s in n for s in args.get("freeze", [])):
            p.requires_grad_(False)
    model = megatrain.wrap(model, device=device, compute_dtype=compute_dtype)
    ga = args["ga"]
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=args.get("lr", 1e-3), weight_decay=0.1, eps=PARITY_EPS,
                                   max_grad_norm=args.get("max_grad_norm"), gradient_accumulation_steps=ga)
    batches = make_batches(cfg.vocab_size, args["steps"], ga, args["b"] * world, args.get("seq", 8),
                           seed=args.get("data_seed", 1))
    losses = []
    for micro in batches:
        total = 0.0
        for x in micro:
            x = x.to(device)
            loss = model(input_ids=x, labels=x).loss / ga
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, megatrain.master_state_dict(model)


def check_parity(res, ref_losses, ref_params, world, frozen=()):
    losses = [sum(r["losses"][s] for r in res) / world for s in range(len(ref_losses))]
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {s}: loss {a} vs {b}"
    params = res[0]["params"]
    assert set(params) == set(ref_params)
    for n in ref_params:
        assert_close_rel(params[n], ref_params[n], 1e-5, n)
    for s, ok in enumerate(res[0]["changed"]):
        bad = [n for n, v in ok.items() if not v]
        assert not bad, f"step {s}: no update (or a frozen parameter changed) in {bad[:4]}"
    diff = max(float((params[n] - ref_params[n]).abs().max()) for n in ref_params)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"{world} ranks: max |param diff| {diff:.3e}, max loss rel diff {loss_diff:.3e}")


@pytest.mark.parametrize("case", [
    dict(ga=2, max_grad_norm=0.05),  # accumulation + clipping (the clip is active: norms are ~1)
    dict(ga=1, max_grad_norm=None, tied=True, freeze=["layers.0.mlp.up_proj"]),  # direct D2H, tied, frozen
])
def test_two_ranks_match_one_rank_with_twice_the_batch(tmp_path, case):
    args = dict(case, b=2, steps=10, check_updates=True)
    res = run_ranks(tmp_path, 2, args)
    ref_losses, ref_params = reference(args, 2)
    check_parity(res, ref_losses, ref_params, 2)


def test_four_ranks(tmp_path):
    args = dict(ga=2, max_grad_norm=0.05, b=1, steps=10, check_updates=True)
    res = run_ranks(tmp_path, 4, args)
    ref_losses, ref_params = reference(args, 4)
    check_parity(res, ref_losses, ref_params, 4)


def _one_rank(args):
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.get("seed", 0))
    model = megatrain.wrap(LlamaForCausalLM(tiny_llama_config()).float(), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=PARITY_EPS,
                                   max_grad_norm=args.get("max_grad_norm"), gradient_accumulation_steps=args["ga"])
    return model, opt


def _train(model, opt, args, world):
    batches = make_batches(model.config.vocab_size, args["steps"], args["ga"], args["b"] * world, 8,
                           seed=args.get("data_seed", 1))
    losses = []
    for step, micro in enumerate(batches):
        if args.get("load_sd") and step == args["load_sd"]["step"]:
            sd = torch.load(args["load_sd"]["path"], weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
        total = 0.0
        for x in micro:
            loss = model(input_ids=x, labels=x).loss / args["ga"]
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_checkpoint_written_by_two_ranks_loads_in_one_and_back(tmp_path):
    # 2 ranks -> 1: the one checkpoint (rank 0 wrote it) holds exactly the shared store's state
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=3, save_end=True)
    (tmp_path / "a").mkdir()
    res = run_ranks(tmp_path / "a", 2, args)
    model, opt = _one_rank(args)
    megatrain.load_checkpoint(str(tmp_path / "a" / "ckpt_end"), model, opt)
    loaded = megatrain.master_state_dict(model)
    for n, t in res[0]["params"].items():
        assert torch.equal(loaded[n], t), n
    assert all(float(opt.state[p]["step"]) == 3 for g in opt.param_groups for p in g["params"])
    # 1 rank -> 2: continue from a checkpoint this process saved; 2 ranks x b == 1 rank x 2b from there
    megatrain.save_checkpoint(str(tmp_path / "one"), model, opt)
    more = dict(args, steps=3, data_seed=5, save_end=False, check_updates=True, load=str(tmp_path / "one"))
    (tmp_path / "b").mkdir()
    res2 = run_ranks(tmp_path / "b", 2, more)
    ref_losses = _train(model, opt, more, 2)
    check_parity(res2, ref_losses, megatrain.master_state_dict(model), 2)


def test_shared_store_is_counted_once(tmp_path):
    # 32 layers of hidden 256: the store (~480 MiB) dominates what each rank adds (slots, activations)
    args = dict(ga=1, b=1, steps=2, config=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=32))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    # large blocks from mmap, so memory a rank freed (its model's weights, copied into the store) is
    # returned to the OS and not counted as if it were still in use
    env = dict(MALLOC_MMAP_THRESHOLD_="131072")
    one = run_ranks(tmp_path / "one", 1, args, env_extra=env)
    two = run_ranks(tmp_path / "two", 2, args, env_extra=env)
    print("PSS growth per rank (MiB):", [round((r["pss"] - r["pss0"]) / 2**20, 1) for r in one + two])
    g1 = one[0]["pss"] - one[0]["pss0"]
    g2 = sum(r["pss"] - r["pss0"] for r in two)
    print(f"PSS growth: 1 rank {g1 / 2**20:.1f} MiB, 2 ranks summed {g2 / 2**20:.1f} MiB, ratio {g2 / g1:.3f}")
    assert g2 <= 1.1 * g1


def wait_exits(procs, limit=150):
    """Wait for every process (killing them after ``limit`` s); returns (outputs, exit time of each, monotonic)."""
    ends = [None] * len(procs)
    deadline = time.monotonic() + limit
    while any(e is None for e in ends) and time.monotonic() < deadline:
        for k, p in enumerate(procs):
            if ends[k] is None and p.poll() is not None:
                ends[k] = time.time()
        time.sleep(0.05)
    outs = []
    for k, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        outs.append(p.communicate()[0])
    return outs, [e if e is not None else float("inf") for e in ends]


def diverged_at(out: str) -> float:
    """The time a rank printed when it left the common path (dp_rank.py's ``DIVERGES <time>``)."""
    return float(next(line for line in out.splitlines() if line.startswith("DIVERGES")).split()[1])


def test_a_rank_that_dies_ends_the_job_and_the_checkpoint_loads(tmp_path):
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=6, save_at=1, die_at=[3, 1])
    procs = launch(tmp_path, 2, args)
    outs, ends = wait_exits(procs)
    assert procs[1].returncode == 17, outs[1][-2000:]
    assert procs[0].returncode not in (0, None), outs[0][-2000:]
    print(f"rank 0 exited {ends[0] - ends[1]:.2f} s after rank 1 died:", outs[0].strip().splitlines()[-1][:400])
    assert ends[0] - ends[1] < 60
    assert "megatrain data parallel" in outs[0] and "exited" in outs[0], outs[0][-2000:]
    model, opt = _one_rank(args)
    megatrain.state.checkpoint.verify_checkpoint(str(tmp_path / "ckpt"))
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert all(float(opt.state[p]["step"]) == 2 for g in opt.param_groups for p in g["params"])


def _state_to_load(tmp_path, args) -> str:
    """A file with a 1-process model's and optimizer's state dicts after 2 steps on other data."""
    from dp_rank import clone

    model, opt = _one_rank(args)
    _train(model, opt, dict(args, steps=2, data_seed=7), 2)
    path = str(tmp_path / "state.pt")
    torch.save({"model": clone(model.state_dict()), "optimizer": clone(opt.state_dict())}, path)
    return path


def test_every_rank_loading_state_dicts_matches_one_rank(tmp_path):
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=5, check_updates=True)
    path = _state_to_load(tmp_path, args)
    args["load_sd"] = dict(step=2, ranks=[0, 1], path=path)
    res = run_ranks(tmp_path, 2, args)
    sd = torch.load(path, weights_only=True)
    for r in res:  # right after the load: the state dicts bit for bit, on every rank (what one process holds)
        for n, t in sd["model"].items():
            assert torch.equal(r["loaded"]["params"][n], t), n
        got = r["loaded"]["optimizer"]
        assert got["param_groups"] == sd["optimizer"]["param_groups"]
        for pid, st in sd["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got["state"][pid][k], st[k]), (pid, k)
    model, opt = _one_rank(args)
    ref_losses = _train(model, opt, args, 2)  # the same load at the same step, one process x the global batch
    check_parity(res, ref_losses, megatrain.master_state_dict(model), 2)


def _diverging_run(tmp_path, args, clear=(0, 1), env_extra=None):
    """Both ranks exit non-zero within 60 s of the divergence, the ranks in ``clear`` with a one-line data
    parallel error; returns each rank's last error line."""
    procs = launch(tmp_path, 2, dict(args, pg_timeout=600), env_extra=env_extra)  # the group's timeout: no help
    outs, ends = wait_exits(procs, limit=90)
    t0 = min(diverged_at(o) for o in outs if "DIVERGES" in o)
    lines = []
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode not in (0, None), f"rank {r} exited with {p.returncode}:\n{out[-3000:]}"
        last = [ln for ln in out.strip().splitlines() if "Error" in ln][-1]
        print(f"rank {r} exited {ends[r] - t0:.2f} s after the divergence: {last[:300]}")
        assert ends[r] - t0 < 60
        if r in clear:
            assert "DataParallelError" in last and "every rank must make this call" in last, out[-3000:]
        lines.append(last)
    return lines


@pytest.mark.parametrize("what", [["model"], ["optimizer"]])
def test_a_state_dict_loaded_on_one_rank_only_stops_every_rank(tmp_path, what):
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=4, save_at=1)
    path = _state_to_load(tmp_path, args)
    args["load_sd"] = dict(step=2, ranks=[0], path=path, what=what)
    lines = _diverging_run(tmp_path, args)
    call = "model.load_state_dict" if what == ["model"] else "optimizer.load_state_dict"
    assert all(f"rank 0 called {call} after 2 optimizer steps, but rank 1 went on training" in ln for ln in lines)
    model, opt = _one_rank(args)  # the checkpoint of step 1 is intact
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)


def test_a_rank_that_stops_early_ends_the_job_and_the_checkpoint_stays(tmp_path):
    # rank 1 stops after 3 steps and saves; rank 0 trains on: neither waits for the other
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=6, save_at=1, stop_at=[3, 1], save_end=True)
    lines = _diverging_run(tmp_path, args)
    assert all("rank 1 called megatrain.save_checkpoint after 3 optimizer steps, but rank 0 went on training" in ln
               for ln in lines)
    assert not (tmp_path / "ckpt_end").exists()
    model, opt = _one_rank(args)
    megatrain.state.checkpoint.verify_checkpoint(str(tmp_path / "ckpt"))
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert all(float(opt.state[p]["step"]) == 2 for g in opt.param_groups for p in g["params"])


def test_a_rank_that_never_makes_the_call_ends_the_job_after_the_timeout(tmp_path):
    # rank 0 saves at the end; rank 1 does not (it waits in its own dist.barrier()): rank 0 gives up after
    # MEGATRAIN_DP_TIMEOUT, and rank 1's barrier fails when rank 0 exits
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=2, save_at=0, save_end=[0])
    lines = _diverging_run(tmp_path, args, clear=(0,), env_extra={"MEGATRAIN_DP_TIMEOUT": "3"})
    assert "rank 0 called megatrain.save_checkpoint after 2 optimizer steps, but rank 1 did not make it within " \
           "MEGATRAIN_DP_TIMEOUT=3 s" in lines[0]
    assert not (tmp_path / "ckpt_end").exists()
    model, opt = _one_rank(args)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert all(float(opt.state[p]["step"]) == 1 for g in opt.param_groups for p in g["params"])


@pytest.mark.cuda
def test_two_gpus_match_one_gpu(tmp_path):
    """NCCL, bf16 compute: 2 GPUs x b vs 1 GPU x 2b (loss within 1e-2 relative, parameter cosine > 0.9999)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    args = dict(ga=2, max_grad_norm=1.0, b=2, steps=10, device="cuda", check_updates=True)
    res = run_ranks(tmp_path, 2, args)
    ref_losses, ref_params = reference(args, 2, device="cuda", compute_dtype=torch.bfloat16)
    losses = [sum(r["losses"][s] for r in res) / 2 for s in range(len(ref_losses))]
    for s, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-2 * abs(b), f"step {s}: loss {a} vs {b}"
    for n, t in ref_params.items():
        cos = torch.nn.functional.cosine_similarity(res[0]["params"][n].double().flatten(), t.double().flatten(), 0)
        assert cos > 0.9999, (n, float(cos))
    for s, ok in enumerate(res[0]["changed"]):
        assert all(ok.values()), f"step {s}: no update in {[n for n, v in ok.items() if not v][:4]}"


def test_cli_under_torchrun_without_data_parallel_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    from parity import run_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MEGATRAIN_DATA_PARALLEL", "0")
    code, _, err = run_cli(["train", "--out", str(tmp_path / "out"), "--device", "cpu"], capsys)
    assert code == 2 and "MEGATRAIN_DATA_PARALLEL=0 under torchrun" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_hf_trainer_under_torchrun_needs_megatrain_trainer_and_a_data_parallel_model():
    from types import SimpleNamespace

    from megatrain.integrations import MegatrainCallback

    with pytest.raises(ValueError, match="under torchrun use megatrain.integrations.MegatrainTrainer"):
        MegatrainCallback().on_init_end(SimpleNamespace(world_size=2), None, None)
    model, _ = _one_rank(dict(ga=1))  # wrapped without a process group: each rank would train its own copy
    with pytest.raises(ValueError, match="wrapped outside their process group"):
        MegatrainCallback().on_train_begin(SimpleNamespace(world_size=2), None, None, model=model)


def test_from_config_initialises_the_shared_store_once(tmp_path):
    args = dict(ga=2, max_grad_norm=0.05, b=2, steps=3, from_config=True, check_updates=True)
    res = run_ranks(tmp_path, 2, args)
    model = megatrain.from_config(tiny_llama_config(), seed=0, device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=0.05,
                                   gradient_accumulation_steps=2)
    ref_losses = _train(model, opt, args, 2)
    check_parity(res, ref_losses, megatrain.master_state_dict(model), 2)


def test_from_pretrained_fills_the_shared_store_once(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).float().save_pretrained(tmp_path / "hf")
    args = dict(ga=1, b=2, steps=3, from_pretrained=str(tmp_path / "hf"), check_updates=True)
    (tmp_path / "run").mkdir()
    res = run_ranks(tmp_path / "run", 2, args)
    model = megatrain.from_pretrained(str(tmp_path / "hf"), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=PARITY_EPS)
    ref_losses = _train(model, opt, args, 2)
    check_parity(res, ref_losses, megatrain.master_state_dict(model), 2)
