"""``WrapOptions`` (wrap's options in one checked value) and ``ActivationPolicy`` (the policy string, typed)."""

import dataclasses
import inspect

import pytest
import torch

import megatrain
from parity import tiny_llama_config
from megatrain.runtime.activations.activation_policy import ActivationPolicy
from megatrain.runtime.placement.estimate import EstimateRun
from megatrain.runtime.wrap_options import ESTIMATE_OPTIONS, WrapOptions


def _tiny():
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(tiny_llama_config())


def _keyword_defaults(fn, skip=()):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty and n not in skip}


def test_options_are_wraps_keywords_with_wraps_defaults_in_its_order():
    wrap_defaults = _keyword_defaults(megatrain.wrap)
    opts = WrapOptions()
    assert WrapOptions.names() == tuple(wrap_defaults)
    assert {n: getattr(opts, n) for n in WrapOptions.names()} == wrap_defaults


def test_estimate_takes_the_options_it_names_with_the_same_defaults():
    est = _keyword_defaults(megatrain.estimate)
    assert {n: est[n] for n in ESTIMATE_OPTIONS} == WrapOptions().as_kwargs(ESTIMATE_OPTIONS)
    run_fields = {f.name for f in dataclasses.fields(EstimateRun)} - {"model_kwargs", "machine"}
    assert {n: est[n] for n in run_fields} == {n: getattr(EstimateRun(), n) for n in run_fields}
    machine = {"host_memory", "gpu_memory"}  # EstimateRun.machine (None, None: this machine)
    assert {n: est[n] for n in machine} == {"host_memory": None, "gpu_memory": None}
    assert set(est) == set(ESTIMATE_OPTIONS) | run_fields | machine


def test_options_are_frozen():
    opts = WrapOptions(num_slots=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_slots = 4
    assert dataclasses.replace(opts, num_slots=4).num_slots == 4 and opts.num_slots == 3


def test_split_separates_model_keywords():
    opts, rest = WrapOptions.split({"num_slots": 3, "attn_implementation": "eager", "liger_kernel": False})
    assert opts == WrapOptions(num_slots=3, liger_kernel=False) and rest == {"attn_implementation": "eager"}


BAD = [
    (dict(num_slots=0), "megatrain.wrap: num_slots must be an int >= 1 (device slots per layer shape; 2 prefetches "
                        "the next layer), got 0"),
    (dict(num_slots=True), "megatrain.wrap: num_slots must be an int >= 1 (device slots per layer shape; 2 prefetches "
                           "the next layer), got True"),
    (dict(reuse_attention=1), "megatrain.wrap: reuse_attention must be True or False, got 1"),
    (dict(lean_activations="yes"), "megatrain.wrap: lean_activations must be True or False, got 'yes'"),
    (dict(grad_accumulator=1), "megatrain.wrap: grad_accumulator must be None (allocated at the first accumulation), "
                               "True or False, got 1"),
    (dict(device=3), "megatrain.wrap: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got 3"),
    (dict(device="gpu"), "megatrain.wrap: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got 'gpu'"),
    (dict(device="meta"), "megatrain.wrap: device must be a CUDA device or 'cpu', got 'meta'"),
    (dict(compute_dtype=torch.float16), "megatrain.wrap: compute_dtype must be torch.bfloat16 or torch.float32, got "
                                        "torch.float16"),
    (dict(activation_policy="block:0"), "megatrain.wrap: activation_policy must be 'recompute', 'store', 'auto', "
                                        "'offload' or 'block:K' (K >= 1), got 'block:0'"),
    (dict(device_state_layers=-1), "megatrain.wrap: device_state_layers must be an int >= 0 (layers 0..K-1 keep their "
                                   "whole training state on the device), 'auto' or 'boundary', got -1"),
    (dict(liger_kernel="on"), "megatrain.wrap: liger_kernel must be None (on when liger-kernel is installed and the "
                              "device is CUDA), True (required) or False (off), got 'on'"),
    (dict(gpu_memory_limit=1.5), "megatrain.wrap: gpu_memory_limit must be a number of bytes (an int >= 1048576, or a "
                                 "string such as '40GiB') or a fraction of the device's memory (a float in (0, 1], e.g. 0.5), got 1.5"),
    (dict(offload_dir=""), "megatrain.wrap: offload_dir must be a directory path, got ''"),
    (dict(host_memory_limit=0), "megatrain.wrap: host_memory_limit must be a number of bytes > 0 (an int, or a "
                                "string such as '100GiB' or '1.5TB'), float('inf') / 'inf' for no limit, or None, got 0"),
    (dict(host_memory_limit="lots"), "megatrain.wrap: host_memory_limit must be a number of bytes > 0 (an int, or a "
                                     "string such as '100GiB' or '1.5TB'), float('inf') / 'inf' for no limit, or None, got 'lots'"),
    (dict(chunked_loss="x"), "megatrain.wrap: chunked_loss must be False, True, 'auto' or a positive number of rows, "
                             "got 'x'"),
    (dict(tile_mlp=0), "megatrain.wrap: tile_mlp must be False, True, 'auto' or a positive number of rows, got 0"),
]  # fmt: skip


_IDS = [next(iter(kw)) + "=" + repr(next(iter(kw.values()))) for kw, _ in BAD]


@pytest.mark.parametrize("kw,message", BAD, ids=_IDS)
def test_each_bad_option_gives_wraps_one_line_message(kw, message):
    with pytest.raises(ValueError) as info:
        WrapOptions(**kw, where="megatrain.wrap")
    assert str(info.value) == message
    model = _tiny()
    with pytest.raises(ValueError) as info:  # wrap says exactly the same, before the model is touched
        megatrain.wrap(model, **{"device": "cpu", **kw})
    assert str(info.value) == message and getattr(model, "megatrain", None) is None


@pytest.mark.parametrize("kw,message", BAD, ids=_IDS)
def test_construction_refuses_each_bad_option_with_the_same_line(kw, message):
    """``WrapOptions(...)`` itself refuses a bad value (not only ``check()`` / ``wrap`` later), with wrap's line
    naming ``megatrain.WrapOptions``."""
    with pytest.raises(ValueError) as info:
        WrapOptions(**kw)
    assert str(info.value) == message.replace("megatrain.wrap:", "megatrain.WrapOptions:", 1)


def test_construction_checks_no_filesystem_and_keeps_unresolved_values(tmp_path):
    """The values ``resolve`` fills (None, "auto") and a directory that is not there yet (its parent missing:
    ``check`` refuses that) construct; ``resolve`` / ``dataclasses.replace`` rebuild checked values."""
    opts = WrapOptions(device=None, activation_policy="auto", device_state_layers="auto", chunked_loss="auto",
                       offload_dir=str(tmp_path / "no" / "such"))
    with pytest.raises(ValueError, match=r"^megatrain\.wrap: the parent of offload_dir="):
        opts.check()
    ok = dataclasses.replace(opts, offload_dir=None).resolve()
    assert ok.device == torch.device("cpu") or ok.device.type == "cuda"
    with pytest.raises(ValueError, match=r"^megatrain\.WrapOptions: num_slots must be"):
        dataclasses.replace(ok, num_slots=0)
    opts, rest = WrapOptions.split({"num_slots": 2, "dtype": torch.float32}, "megatrain.from_config")
    with pytest.raises(ValueError, match=r"^megatrain\.from_config: num_slots must be"):
        WrapOptions.split({"num_slots": 0}, "megatrain.from_config")


def test_where_names_the_caller():
    with pytest.raises(ValueError, match=r"^megatrain\.estimate: activation_policy must be"):
        WrapOptions(activation_policy="x", where="megatrain.estimate")
    with pytest.raises(ValueError, match=r"^megatrain\.from_config: activation_policy must be"):
        megatrain.from_config(tiny_llama_config(), activation_policy="x")


@pytest.mark.parametrize("kw", [dict(activation_policy="bogus"), dict(chunked_loss="x"), dict(tile_mlp=0),
                                dict(num_slots=0)], ids=lambda kw: next(iter(kw)))
def test_estimates_messages_name_estimate(kw):
    """``megatrain.estimate``'s one-line message for a bad option names it, not ``megatrain.wrap``."""
    with pytest.raises(ValueError) as info:
        megatrain.estimate(tiny_llama_config(), device="cpu", **kw)
    name = next(iter(kw))
    assert str(info.value).startswith(f"megatrain.estimate: {name} must be") and "megatrain.wrap" not in str(info.value)


@pytest.mark.parametrize("text,n", [("100GiB", 100 * 2**30), ("1.5TB", 1_500_000_000_000), (2**33, 2**33),
                                    ("512 MiB", 2**29)])
def test_host_memory_limit_takes_a_size_string_as_estimate_does(text, n):
    """``host_memory_limit`` takes what ``estimate(host_memory=)`` takes (``parse_bytes``), held in bytes;
    wrap runs with the bytes."""
    assert WrapOptions(host_memory_limit=text).host_memory_limit == n
    assert WrapOptions(host_memory_limit=text).resolve().host_memory_limit == n
    est = megatrain.estimate(tiny_llama_config(), device="cpu", host_memory_limit=text)
    assert est.host_memory_limit == n


def test_wrap_runs_with_a_size_string_limit():
    m = megatrain.wrap(_tiny(), device="cpu", host_memory_limit="1GiB")
    assert m.megatrain.offload_plan.host_memory_limit == 2**30
    with pytest.raises(MemoryError, match="host_memory_limit"):  # HostMemoryError
        megatrain.wrap(_tiny(), device="cpu", host_memory_limit="1KiB")


def test_resolve_fills_wraps_defaults_on_the_cpu():
    opts = WrapOptions(device="cpu", chunked_loss=None, tile_mlp=256).resolve()
    assert opts.device == torch.device("cpu") and opts.compute_dtype == torch.float32
    assert opts.activation_policy == ActivationPolicy("recompute") and opts.device_state_layers == 0
    assert opts.chunked_loss is False and opts.tile_mlp == 256
    assert opts.gpu_memory_limit is None and opts.liger_kernel is False  # no cap, no Liger off CUDA


def test_resolve_refuses_cuda_where_there_is_none():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=r"^megatrain\.wrap: device 'cuda' requested, but CUDA is not available"):
        WrapOptions(device="cuda").resolve()
    plan = WrapOptions(device="cuda").with_defaults("megatrain.estimate", need_device=False)  # estimate plans for it
    assert plan.device == torch.device("cuda") and plan.compute_dtype == torch.bfloat16 and plan.activation_policy.is_auto


@pytest.mark.parametrize("text,kind,k", [("recompute", "recompute", 1), ("store", "store", 1), ("auto", "auto", 1),
                                         ("offload", "offload", 1), ("block:4", "block", 4), ("block:1", "block", 1),
                                         ("block:04", "block", 4)])
def test_policy_parses_each_form_and_keeps_the_string(text, kind, k):
    p = ActivationPolicy.parse(text)
    assert (p.kind, p.block_k) == (kind, k)
    assert str(p) == text  # the user's string, as metrics and summary.json show it
    assert ActivationPolicy.parse(p) is p


def test_policy_questions():
    rec, store, auto, off, blk = (ActivationPolicy.parse(t) for t in ("recompute", "store", "auto", "offload", "block:2"))
    assert [p.recomputes for p in (rec, store, auto, off, blk)] == [True, False, False, True, True]
    assert store.stores and not blk.stores and auto.is_auto and off.offloads and blk.is_block
    assert ActivationPolicy.block(3) == ActivationPolicy.parse("block:3") and str(ActivationPolicy.block(3)) == "block:3"
    assert ActivationPolicy.default("cpu") == rec and ActivationPolicy.default(torch.device("cuda", 0)) == auto
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.kind = "store"


@pytest.mark.parametrize("bad", ["sometimes", "block:0", "store\n", "block:", "Block:2", None, 2])
def test_policy_parse_refuses_with_todays_message(bad):
    with pytest.raises(ValueError) as info:
        ActivationPolicy.parse(bad, "runtime.activation_policy")
    assert str(info.value) == ("runtime.activation_policy must be 'recompute', 'store', 'auto', 'offload' or 'block:K' "
                               f"(K >= 1), got {bad!r}")


def test_engine_keeps_the_policy_string():
    model = megatrain.wrap(_tiny(), device="cpu", activation_policy="block:02")
    eng = model.megatrain
    assert eng.activation_policy == "block:02" and eng.block_k == 2 and eng.placement()["activation_policy"] == "block:02"
