"""megatrain::adamw_step_ / grad_accumulate_ against torch.optim.AdamW, on every CPU ISA here."""

import subprocess
import sys

import pytest
import torch

import megatrain.ops as ops
from megatrain._ext import _C as C

SUPPORTED_ISAS = C.supported_isas()
LR_WD = [(1e-3, 0.0), (3e-3, 0.1)]  # two parameter groups


@pytest.fixture(params=SUPPORTED_ISAS)
def isa(request):
    before = C.cpu_isa()
    C.set_cpu_isa(request.param)
    yield request.param
    C.set_cpu_isa(before)


def _run_three_ways(n, steps, grad_dtype, grad_std, seed):
    """Runs our op, torch AdamW float64 and torch AdamW float32 on the same data.

    Returns per group: (ours, ref64 optimizer state, ref32 optimizer state, p0, max|g| per element).
    """
    gen = torch.Generator().manual_seed(seed)
    ours, p64, p32, p0s, gmax = [], [], [], [], []
    for _ in LR_WD:
        p0 = torch.randn(n, generator=gen)
        p0s.append(p0)
        ours.append(dict(master=p0.clone(), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                         compute=torch.empty(n, dtype=torch.bfloat16)))
        p64.append(torch.nn.Parameter(p0.double()))
        p32.append(torch.nn.Parameter(p0.clone()))
        gmax.append(torch.zeros(n, dtype=torch.float64))
    groups = lambda ps: [dict(params=[p], lr=lr, weight_decay=wd) for p, (lr, wd) in zip(ps, LR_WD)]
    opt64 = torch.optim.AdamW(groups(p64), betas=(0.9, 0.999), eps=1e-8, foreach=False)
    opt32 = torch.optim.AdamW(groups(p32), betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for step in range(1, steps + 1):
        for i, (lr, wd) in enumerate(LR_WD):
            grad = (torch.randn(n, generator=gen) * grad_std).to(grad_dtype)
            exact = grad.double()  # the reference sees exactly the values our kernel reads
            gmax[i] = torch.maximum(gmax[i], exact.abs())
            p64[i].grad = exact
            p32[i].grad = exact.float()
            o = ours[i]
            ops.adamw_step_(o["master"], o["exp_avg"], o["exp_avg_sq"], grad, o["compute"], lr=lr,
                            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=step)
            # The compute copy is written in the same pass: bf16 round-to-nearest-even of master.
            assert torch.equal(o["compute"], o["master"].to(torch.bfloat16)), f"step {step} group {i}"
        opt64.step()
        opt32.step()
    return [(ours[i], p64[i], opt64.state[p64[i]], p32[i], opt32.state[p32[i]], p0s[i], gmax[i])
            for i in range(len(LR_WD))]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["grad_fp32", "grad_bf16"])
@pytest.mark.parametrize("grad_std", [1.0, 1e-2], ids=["grad_std_1", "grad_std_1e-2"])
def test_ten_steps_two_param_groups_match_float64_torch_adamw_per_element(isa, grad_dtype, grad_std):
    """Every element within 1e-6 relative of torch.optim.AdamW run in float64.

    Absolute slack: fp32 state that cancels towards zero keeps the rounding error of the operands
    it came from, so the per-element slack is 1e-6 x the operand scale (|p0| for master, max|g|
    over the steps for exp_avg) plus 1e-9. exp_avg_sq (a sum of non-negative terms) gets only 1e-9.
    torch.optim.AdamW in float32 needs this same slack (it misses a bare 1e-6*|b| + 1e-9 on ~2% of
    exp_avg elements); we also require our error to be no larger than twice torch-fp32's.
    """
    n = 70_001  # two 64K chunks (multithreaded) plus a remainder
    for g, (o, p64, s64, p32, s32, p0, gmax) in enumerate(_run_three_ways(n, 10, grad_dtype, grad_std, seed=1)):
        cases = [
            ("master", o["master"], p64.detach(), p32.detach(), p0.double().abs()),
            ("exp_avg", o["exp_avg"], s64["exp_avg"], s32["exp_avg"], gmax),
            ("exp_avg_sq", o["exp_avg_sq"], s64["exp_avg_sq"], s32["exp_avg_sq"], torch.zeros_like(gmax)),
        ]
        for name, ours, ref, torch32, scale in cases:
            err = (ours.double() - ref).abs()
            tol = 1e-6 * ref.abs() + 1e-6 * scale + 1e-9
            bad = (err > tol).nonzero()
            assert bad.numel() == 0, (
                f"group {g} {name}: {bad.numel()} elements off, first {bad[0].item()}: "
                f"ours {ours[bad[0]].item()!r} ref {ref[bad[0]].item()!r}")
            ours_worst = (err / tol).max().item()
            torch_worst = ((torch32.double() - ref).abs() / tol).max().item()
            assert ours_worst <= 2 * torch_worst + 1e-3, (name, ours_worst, torch_worst)


def test_zero_gradient_applies_only_decoupled_weight_decay(isa):
    """A kernel that applied L2 (Adam) instead of decoupled decay would miss this."""
    torch.manual_seed(2)
    n = 1000
    p = torch.randn(n) * 10
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.zeros(n)  # zero gradient: only weight decay moves the weights
    ops.adamw_step_(p, m, v, g, None, lr=0.1, weight_decay=0.5, step=1)
    p0 = p.clone()
    # decoupled decay with zero grad: p *= (1 - lr*wd) exactly (fp32 rounding of the factor)
    torch.manual_seed(2)
    expected = torch.randn(n) * 10 * torch.tensor(1 - 0.1 * 0.5, dtype=torch.float32)
    assert torch.equal(p0, expected)
    assert torch.count_nonzero(m) == 0 and torch.count_nonzero(v) == 0


def test_grad_scale_multiplies_the_gradient_before_anything_else(isa):
    torch.manual_seed(3)
    n = 4099
    base = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    grad = torch.randn(n)
    a = [t.clone() for t in base]
    b = [t.clone() for t in base]
    ops.adamw_step_(*a, grad, None, lr=1e-3, weight_decay=0.1, step=5, grad_scale=0.37)
    ops.adamw_step_(*b, grad * 0.37, None, lr=1e-3, weight_decay=0.1, step=5, grad_scale=1.0)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fp32_compute_out_is_an_exact_copy_of_master(isa):
    torch.manual_seed(4)
    n = 1023
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.full((n,), float("nan"))
    ops.adamw_step_(p, m, v, torch.randn(n), out, lr=1e-2, step=1)
    assert torch.equal(out, p)


@pytest.mark.parametrize("n", [1, 15, 17, 22, 4099, 2**20 + 3])
def test_every_isa_bitwise_equal_to_scalar(n):
    """Same rounding in every variant, including remainders and multi-chunk threading."""
    torch.manual_seed(5)
    state0 = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    grad = torch.randn(n).to(torch.bfloat16)
    before = C.cpu_isa()
    results = {}
    try:
        for name in SUPPORTED_ISAS:
            C.set_cpu_isa(name)
            st = [t.clone() for t in state0]
            out = torch.empty(n, dtype=torch.bfloat16)
            for step in (1, 2):
                ops.adamw_step_(*st, grad, out, lr=1e-3, weight_decay=0.1, step=step, grad_scale=0.9)
            results[name] = st + [out]
    finally:
        C.set_cpu_isa(before)
    for name, tensors in results.items():
        for t, ref in zip(tensors, results["scalar"]):
            assert torch.equal(t, ref), name


def test_result_does_not_depend_on_thread_count(isa):
    torch.manual_seed(6)
    n = 300_007
    state0 = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    grad = torch.randn(n)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            st = [x.clone() for x in state0]
            ops.adamw_step_(*st, grad, None, lr=1e-3, step=3)
            acc = torch.zeros(n)
            s = ops.grad_accumulate_(acc, grad, True)
            outs.append((st, s.item()))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(outs[0][0], outs[1][0]))
    assert outs[0][1] == outs[1][1]


# --- errors ---------------------------------------------------------------------------------

def _state(n=64):
    return torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)


def test_non_contiguous_master_is_rejected_not_copied():
    big = torch.zeros(128)
    p = big[::2]
    m, v, g = torch.zeros(64), torch.zeros(64), torch.ones(64)
    with pytest.raises(ValueError, match=r"master must be contiguous.*strides \[2\]"):
        ops.adamw_step_(p, m, v, g, None, lr=1e-3, step=1)
    assert torch.count_nonzero(big) == 0 and torch.count_nonzero(m) == 0


def test_non_contiguous_grad_is_rejected():
    p, m, v, _ = _state()
    g = torch.ones(64, 2)[:, 0]
    with pytest.raises(ValueError, match="grad must be contiguous"):
        ops.adamw_step_(p, m, v, g, None, lr=1e-3, step=1)


@pytest.mark.parametrize("which", ["master", "exp_avg", "exp_avg_sq"])
def test_wrong_state_dtype_is_rejected_with_what_was_found(which):
    t = dict(zip(["master", "exp_avg", "exp_avg_sq", "grad"], _state()))
    t[which] = t[which].double()
    with pytest.raises(TypeError, match=f"{which} must be a contiguous float32 CPU tensor, got dtype Double"):
        ops.adamw_step_(t["master"], t["exp_avg"], t["exp_avg_sq"], t["grad"], None, lr=1e-3, step=1)


def test_wrong_grad_and_compute_out_dtypes_are_rejected():
    p, m, v, g = _state()
    with pytest.raises(TypeError, match="grad must be a contiguous float32 or bfloat16 CPU tensor, got dtype Half"):
        ops.adamw_step_(p, m, v, g.half(), None, lr=1e-3, step=1)
    with pytest.raises(TypeError, match="compute_out must be a contiguous bfloat16 or float32 CPU tensor, got dtype Half"):
        ops.adamw_step_(p, m, v, g, torch.zeros(64, dtype=torch.half), lr=1e-3, step=1)


def test_numel_mismatch_and_bad_step_are_rejected():
    p, m, v, g = _state()
    with pytest.raises(ValueError, match="exp_avg_sq must have 64 elements .*got 63"):
        ops.adamw_step_(p, m, v[:63], g, None, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adamw_step_(p, m, v, g, None, lr=1e-3, step=0)


# --- grad_accumulate_ ------------------------------------------------------------------------

@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["grad_fp32", "grad_bf16"])
def test_grad_accumulate_overwrite_then_add_returns_sum_of_squares(isa, grad_dtype):
    torch.manual_seed(7)
    n = 200_003
    acc = torch.full((n,), 123.0)
    g1, g2 = torch.randn(n).to(grad_dtype), torch.randn(n).to(grad_dtype)
    s1 = ops.grad_accumulate_(acc, g1, True)
    assert torch.equal(acc, g1.float())
    assert s1.dtype == torch.float64 and s1.dim() == 0
    torch.testing.assert_close(s1, (g1.double() ** 2).sum(), rtol=1e-12, atol=0)
    s2 = ops.grad_accumulate_(acc, g2, False)
    assert torch.equal(acc, g1.float() + g2.float())
    torch.testing.assert_close(s2, (acc.double() ** 2).sum(), rtol=1e-12, atol=0)


def test_grad_accumulate_rejects_bad_inputs():
    with pytest.raises(TypeError, match="accum must be a contiguous float32 CPU tensor, got dtype BFloat16"):
        ops.grad_accumulate_(torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), True)
    with pytest.raises(ValueError, match="accum must be contiguous"):
        ops.grad_accumulate_(torch.zeros(8, 2)[:, 1], torch.zeros(8), True)
    with pytest.raises(ValueError, match="grad must have 8 elements"):
        ops.grad_accumulate_(torch.zeros(8), torch.zeros(9), True)


# --- torch.library ---------------------------------------------------------------------------

def test_opcheck_adamw_step():
    torch.manual_seed(8)
    n = 1000
    args = (torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01, torch.randn(n).bfloat16(),
            torch.empty(n, dtype=torch.bfloat16), 1e-3, 0.9, 0.999, 1e-8, 0.1, 3, 1.0)
    torch.library.opcheck(torch.ops.megatrain.adamw_step_.default, args)


def test_opcheck_grad_accumulate():
    torch.manual_seed(9)
    args = (torch.randn(1000), torch.randn(1000), False)
    torch.library.opcheck(torch.ops.megatrain.grad_accumulate_.default, args)


# --- memory-bandwidth switches (csrc/megatrain/common/tuning.h) ------------------------------

@pytest.fixture
def restore_tuning():
    before = C.tuning()
    yield
    C.set_tuning(**before)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["out_bf16", "out_fp32"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["grad_fp32", "grad_bf16"])
def test_streaming_stores_and_prefetch_do_not_change_a_bit(isa, out_dtype, grad_dtype, restore_tuning):
    """MEGATRAIN_ADAM_NT_STORES / MEGATRAIN_ADAM_PREFETCH change only how memory is written/read.

    Outputs that start off a 64-byte boundary and sizes with ragged ends, above the default
    streaming threshold (2^20 elements) and below it with the threshold lowered to 0.
    """
    torch.manual_seed(11)
    for n, min_numel in ((2**20 + 4099, None), (70_001, 0)):
        state0 = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
        grads = [(torch.randn(n) * 0.1).to(grad_dtype) for _ in range(2)]
        results = []
        for nt, pf in ((False, 0), (True, 0), (True, 1024)):
            C.set_tuning(nt_stores=nt, prefetch_bytes=pf,
                         **({} if min_numel is None else {"nt_min_numel": min_numel}))
            st = [t.clone() for t in state0]
            base = torch.full((n + 40,), float("nan"), dtype=out_dtype)
            out = base[5:5 + n]  # 10 or 20 bytes past a 64-byte boundary
            for step, g in enumerate(grads, 1):
                ops.adamw_step_(*st, g, out, lr=1e-3, weight_decay=0.1, step=step, grad_scale=0.7)
            assert torch.equal(out, st[0].to(out_dtype))
            assert base[:5].isnan().all() and base[5 + n:].isnan().all()  # nothing written outside
            results.append(st + [out.clone()])
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert torch.equal(a, b)


def test_gradient_read_from_the_compute_copy_it_overwrites_is_unaffected_by_streaming_stores(isa, restore_tuning):
    """Training's direct D2H path: grad and compute_out are the same bf16 tensor."""
    torch.manual_seed(12)
    n = 2**20 + 777
    state0 = [torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    g0 = (torch.randn(n) * 0.1).to(torch.bfloat16)
    results = []
    for nt in (False, True):
        C.set_tuning(nt_stores=nt, nt_min_numel=0)
        st = [t.clone() for t in state0]
        comp = g0.clone()
        ops.adamw_step_(*st, comp, comp, lr=1e-3, weight_decay=0.1, step=1)
        assert torch.equal(comp, st[0].to(torch.bfloat16))
        results.append(st + [comp])
    ref = [t.clone() for t in state0]
    out = torch.empty(n, dtype=torch.bfloat16)
    ops.adamw_step_(*ref, g0, out, lr=1e-3, weight_decay=0.1, step=1)  # separate buffers
    for got in results:
        for a, b in zip(got, ref + [out]):
            assert torch.equal(a, b)


def test_tuning_set_returns_previous_and_rejects_bad_values(restore_tuning):
    before = C.tuning()
    assert set(before) == {"hugepages", "store_skew", "nt_stores", "nt_min_numel", "prefetch_bytes"}
    prev = C.set_tuning(nt_stores=not before["nt_stores"], prefetch_bytes=256)
    assert prev == before
    now = C.tuning()
    assert now["nt_stores"] == (not before["nt_stores"]) and now["prefetch_bytes"] == 256
    assert now["hugepages"] == before["hugepages"] and now["nt_min_numel"] == before["nt_min_numel"]
    assert now["store_skew"] == before["store_skew"]
    with pytest.raises(ValueError):
        C.set_tuning(prefetch_bytes=-1)
    with pytest.raises(ValueError):
        C.set_tuning(nt_min_numel=-1)


@pytest.mark.parametrize("hugepages", [True, False])
def test_host_store_arena_huge_page_advice_follows_the_switch(hugepages, restore_tuning):
    C.set_tuning(hugepages=hugepages)
    store = C.HostStore([[("w", [1 << 20])]], torch.bfloat16)  # ~14 MiB arena
    assert store.hugepage_advised == hugepages
    master = store.section(0, "master")
    assert master.data_ptr() % 4096 == 0
    master.fill_(1.0)
    hp = C.huge_page_bytes(master)
    assert -1 <= hp <= master.numel() * 4
    if not hugepages and C.transparent_hugepage_mode() != "unknown":
        assert hp == 0
    small = C.pinned_empty(1000, torch.float32)  # below 2 MiB: never advised, still usable
    assert small.data_ptr() % 4096 == 0 and torch.equal(small, torch.zeros(1000))


@pytest.mark.parametrize("skew", [True, False])
def test_large_store_units_stagger_their_sections_unless_switched_off(skew, restore_tuning):
    """MEGATRAIN_STORE_SKEW: fp32 sections of a large unit are not a power of two apart."""
    C.set_tuning(store_skew=skew)
    n = (1 << 22) + 64  # 16 MiB + 256 B fp32 sections
    store = C.HostStore([[("w", [n])]], torch.bfloat16, True)
    assert store.skew_sections == skew
    names = ["compute", "master", "exp_avg", "exp_avg_sq", "grad_accum"]
    ptrs = [store.section(0, s).data_ptr() for s in names]
    sizes = [-(-store.section(0, s).numel() * store.section(0, s).element_size() // 4096) * 4096 for s in names]
    assert all(p % 4096 == 0 for p in ptrs)
    gaps = [ptrs[k + 1] - (ptrs[k] + sizes[k]) for k in range(len(names) - 1)]
    if skew:
        assert all(0 <= g < 256 << 10 for g in gaps) and any(g > 0 for g in gaps)
        fp32 = ptrs[1:]
        assert all((a - b) % (256 << 10) != 0 for a in fp32 for b in fp32 if a != b)
    else:
        assert gaps == [0, 0, 0, 0]
    assert C.HostStore.bytes_required([[("w", [n])]], torch.bfloat16, True) == store.total_bytes
    # Sections stay independent: writing one leaves the others (and the gaps) zero.
    store.section(0, "master").fill_(1.0)
    assert store.section(0, "exp_avg").abs().sum() == 0 and store.section(0, "compute").abs().sum() == 0


def test_bench_stream_kernels_compute_and_count_bytes():
    import megatrain._bench  # noqa: F401  (registers torch.ops.megatrain.bench_stream)

    n = 70_001
    p, m, v = torch.randn(n), torch.randn(n), torch.rand(n)
    g = torch.randn(n)
    for nt in (False, True):
        dst = torch.zeros(n)
        assert torch.ops.megatrain.bench_stream("copy", [dst, p], nt) == 8 * n
        assert torch.equal(dst, p)
        a = torch.zeros(n)
        assert torch.ops.megatrain.bench_stream("triad", [a, p, m], nt) == 12 * n
        assert torch.equal(a, p + 3.0 * m)
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        out = torch.zeros(n, dtype=torch.bfloat16)
        assert torch.ops.megatrain.bench_stream("adam", [pp, mm, vv, g, out], nt) == 30 * n
        assert torch.equal(pp, p * 0.5 + g) and torch.equal(mm, m * 0.5 + g)
        assert torch.equal(vv, v * 0.5 + g * g)
        assert torch.ops.megatrain.bench_stream("adam", [pp, mm, vv, g.to(torch.bfloat16), out], nt) == 28 * n
    with pytest.raises(Exception):
        torch.ops.megatrain.bench_stream("scale", [p, m], False)
    for isa in C.supported_isas():  # an explicit ISA (what benchmarks pass: _C.cpu_isa()) computes the same
        dst = torch.zeros(n)
        assert torch.ops.megatrain.bench_stream("copy", [dst, p], False, isa) == 8 * n and torch.equal(dst, p)


def test_bench_kernels_are_not_in_the_core_extension():
    code = ("import torch, megatrain, megatrain.ops; "
            "print(hasattr(torch.ops.megatrain, 'adamw_step_'), hasattr(torch.ops.megatrain, 'bench_stream'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"], out
