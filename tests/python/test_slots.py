"""The device slot pool and the copy streams of the C++ scheduler (``_C.SlotPool``, ``_C.CudaEvent``,
``_C.copy_to_host``) against the Python path they replace (``Options.cpp_slots=False``).

CPU: training gives the same bits with either pool (same loads, same hits); the bindings refuse
bad buffers. CUDA (H200): the events and copies themselves, and training with either pool.
"""

import copy

import pytest
import torch
import transformers

import megatrain
from megatrain._loader import load_extension
from megatrain.runtime.options import options_set
from megatrain.runtime.engine.slots import NativeSlot, Slot

_C = load_extension()


def _tiny(layers: int = 3):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _train(model, cpp: bool, device: str, steps: int = 3, micro: int = 2, **wrap_kw):
    """A few steps with gradient accumulation and an evaluation forward between the last backward and
    step() (a load of weights rebuilt from the masters). Returns (losses, eval logits, masters, stats)."""
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, 96, (2, 16), generator=g) for _ in range(micro)] for _ in range(steps)]
    with options_set(cpp_slots=cpp):
        m = megatrain.wrap(copy.deepcopy(model), device=device, **wrap_kw)
    eng = m.megatrain
    assert eng.cpp_slots is cpp
    assert all(isinstance(s, NativeSlot if cpp else Slot) for ss in eng.slots.values() for s in ss)
    opt = megatrain.optim.CPUAdamW(m.parameters(), lr=1e-3, weight_decay=0.1, gradient_accumulation_steps=micro)
    losses, evals = [], []
    for mb in batches:
        for x in mb:
            x = x.to(device)
            loss = m(input_ids=x, labels=x).loss / micro
            loss.backward()
            losses.append(loss.item())
        with torch.no_grad():
            evals.append(m(input_ids=mb[0].to(device)).logits.float().cpu())
        opt.step()
        opt.zero_grad()
    stats = eng.stats()
    masters = megatrain.master_state_dict(m)
    eng.close()
    return losses, evals, masters, stats


@pytest.mark.parametrize("wrap_kw", [
    dict(compute_dtype=torch.float32),
    dict(compute_dtype=torch.bfloat16, num_slots=3),
    dict(compute_dtype=torch.float32, activation_policy="store", num_slots=2),
], ids=["fp32", "bf16_3slots", "store"])
def test_cpu_training_is_bit_identical_with_the_cpp_and_the_python_pool(wrap_kw):
    model = _tiny()
    runs = {cpp: _train(model, cpp, "cpu", **wrap_kw) for cpp in (True, False)}
    (l1, e1, m1, s1), (l0, e0, m0, s0) = runs[True], runs[False]
    assert l1 == l0
    assert all(torch.equal(a, b) for a, b in zip(e1, e0))
    assert m1.keys() == m0.keys() and all(torch.equal(m1[k], m0[k]) for k in m0)
    # the same loads and the same reuse decisions
    for key in ("h2d_copies", "h2d_bytes", "slot_hits", "d2h_bytes"):
        assert s1[key] == s0[key], (key, s1[key], s0[key])
    assert s1["slot_hits"] > 0 and s1["h2d_copies"] > 0


def test_cpu_pool_binding_moves_a_slot_through_load_acquire_release():
    pool = _C.SlotPool(False)
    bufs = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(2)]
    assert [pool.add_slot(4, b) for b in bufs] == [0, 1]
    src = torch.arange(8, dtype=torch.float32).to(torch.bfloat16)
    assert pool.pick(4) == 0 and pool.find(4, 7, 0) == -1
    pool.load(0, 7, 0, src)
    assert torch.equal(bufs[0], src) and pool.find(4, 7, 0) == 0 and pool.find(4, 7, 1) == -1
    pool.acquire(0)
    st = pool.state(0)
    assert (st["unit"], st["version"], st["in_use"], st["free_recorded"]) == (7, 0, 1, False)
    assert pool.pick(4) == 1 and pool.pick(4, [1]) == -1
    with pytest.raises(RuntimeError, match="is in use"):
        pool.load(0, 8, 0, src)
    assert pool.release(0) == 0 and pool.state(0)["free_recorded"]
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release(0)
    pool.drop_template(4)
    assert pool.pick(4) == -1 and pool.find(4, 7, 0) == -1
    with pytest.raises(IndexError, match="no live slot"):
        pool.buffer(0)


def test_cpu_pool_binding_refuses_bad_buffers_and_sources():
    pool = _C.SlotPool(False)
    pool.add_slot(0, torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        pool.load(0, 1, 0, torch.zeros(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="bytes into slot"):
        pool.load(0, 1, 0, torch.zeros(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        pool.load(0, 1, 0, torch.zeros(16, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        pool.add_slot(0, torch.zeros(4, 4)[:, 0])
    assert pool.state(0)["unit"] == -1


def test_cuda_entry_points_refuse_in_a_build_without_cuda():
    if _C.streams_have_cuda():
        pytest.skip("built with CUDA")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        _C.CudaEvent()
    with pytest.raises(RuntimeError, match="built without CUDA"):
        _C.SlotPool(True, 1, 0)


# ---------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_event_records_queries_and_times():
    s = torch.cuda.Stream()
    a, b = _C.CudaEvent(True), _C.CudaEvent(True)
    assert a.cuda_event != 0 and a.query()  # never recorded: complete
    a.record(s.cuda_stream)
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
    b.record(s.cuda_stream)
    assert not b.query()  # the sleep is still running
    b.synchronize()
    assert b.query() and a.elapsed_time(b) > 0.5


@pytest.mark.cuda
def test_cuda_copy_to_host_waits_for_the_compute_stream():
    compute = torch.cuda.current_stream()
    d2h = torch.cuda.Stream()
    src = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)  # the copy must not start before this and the fill
        src.fill_(3.0)
    dst = torch.empty(1 << 20, pin_memory=True)
    done = _C.CudaEvent()
    _C.copy_to_host([(dst, src)], d2h.cuda_stream, after_stream=compute.cuda_stream, done=done)
    done.synchronize()
    assert bool((dst == 3.0).all())


@pytest.mark.cuda
def test_cuda_slot_pool_loads_waits_and_reuses():
    h2d = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    pool = _C.SlotPool(True, h2d.cuda_stream, torch.cuda.current_device())
    buf = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")
    pool.add_slot(0, buf)
    a = torch.full((1 << 20,), 1.0, dtype=torch.bfloat16).pin_memory()
    b = torch.full((1 << 20,), 2.0, dtype=torch.bfloat16).pin_memory()
    start, end = _C.CudaEvent(True), _C.CudaEvent(True)
    pool.load(0, 5, 0, a, timing=(start, end))
    pool.acquire(0, compute.cuda_stream)
    got = buf.float().sum().item()  # on the compute stream, after weights_ready
    assert got == float(1 << 20)
    with torch.cuda.stream(compute):
        torch.cuda._sleep(20_000_000)  # still reading the slot when the next load is enqueued
        first = buf.float().sum()
    pool.release(0, compute.cuda_stream)
    pool.load(0, 6, 0, b)  # waits for buffer_free: must not overwrite under the sleep's read
    pool.acquire(0, compute.cuda_stream)
    second = buf.float().sum()
    assert first.item() == float(1 << 20) and second.item() == 2.0 * (1 << 20)
    assert pool.ready(0) and start.elapsed_time(end) >= 0
    pool.release(0, compute.cuda_stream)


@pytest.mark.cuda
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "race_debug"])
def test_cuda_training_with_the_cpp_and_the_python_pool_agrees(debug):
    model = _tiny(4)
    runs = {}
    for cpp in (True, False):
        with options_set(debug_races=debug):
            runs[cpp] = _train(model, cpp, "cuda", compute_dtype=torch.bfloat16, activation_policy="recompute")
    (l1, _, m1, s1), (l0, _, m0, s0) = runs[True], runs[False]
    assert max(abs(a - b) / abs(b) for a, b in zip(l1, l0)) < 1e-3, (l1, l0)
    for k in m0:
        cos = torch.nn.functional.cosine_similarity(m1[k].double().flatten(), m0[k].double().flatten(), dim=0)
        assert cos > 0.99999, (k, float(cos))
    for key in ("h2d_copies", "h2d_bytes", "slot_hits", "d2h_bytes"):
        assert s1[key] == s0[key], (key, s1[key], s0[key])
    assert s1["h2d_time_s"] > 0 and s1["d2h_time_s"] > 0
