"""megatrain.estimate: the host bytes it says are the bytes the real store, staging and accumulator take;
whether it fits follows the budget check's limits; a directory is estimated from its headers alone."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import megatrain  # noqa: E402
from parity import tiny_gpt2_config, tiny_llama_config  # noqa: E402
from megatrain.runtime.placement import host_memory


_llama = tiny_llama_config
_gpt2 = tiny_gpt2_config


def _real_bytes(model):
    """What the wrapped model's engine allocated, read from the objects themselves."""
    eng = model.megatrain
    elem = torch.tensor([], dtype=eng.compute_dtype).element_size()
    # the staging pool is allocated on first use: its bound (what the budget check counts)
    staging = eng.grads.staging_max * eng.grads.staging_numel * elem
    if eng.resident is not None:
        staging += eng.resident_staging().numel() * eng.resident_staging().element_size()
    slots = sum(s.buf.numel() * s.buf.element_size() for ss in eng.slots.values() for s in ss)
    resident = 0
    if eng.resident is not None:
        resident = eng.resident_buf.numel() * elem + elem * sum(e.numel for e in eng.resident.entries if not e.frozen)
    return dict(sections=dict(eng.store.section_bytes), store=int(eng.store.total_bytes), staging=staging,
                accum=0 if eng.accumulator_mode is True else eng.accumulator_bytes(),  # outside the store
                slots=slots, resident=resident,
                frozen=int(eng.store.frozen_numel), numel=int(eng.store.total_numel))


def _check(est, real):
    assert est.host_sections == real["sections"]
    assert est.store_bytes == real["store"]
    assert est.staging_bytes == real["staging"]
    assert est.accumulator_bytes == real["accum"]
    assert est.host_bytes == real["store"] + real["staging"] + real["accum"]
    assert est.slot_bytes == real["slots"]
    assert est.resident_bytes == real["resident"]
    assert est.frozen_params == real["frozen"] and est.num_params == real["numel"]
    assert est.trainable_params == real["numel"] - real["frozen"]


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [_llama(), _llama(tied=True), _gpt2()], ids=["llama", "llama-tied", "gpt2-tied"])
@pytest.mark.parametrize("accum", ["none", "auto-gas2", "in-store"])
def test_estimate_of_a_config_equals_the_real_store(cfg, compute_dtype, accum):
    gas = 2 if accum == "auto-gas2" else 1
    grad_accumulator = True if accum == "in-store" else None
    est = megatrain.estimate(cfg, device="cpu", compute_dtype=compute_dtype, grad_accumulator=grad_accumulator,
                             gradient_accumulation_steps=gas, seq_len=16, micro_batch_size=2)
    model = megatrain.from_config(cfg, seed=0, device="cpu", compute_dtype=compute_dtype,
                                  grad_accumulator=grad_accumulator)
    megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=gas)
    real = _real_bytes(model)
    assert (real["accum"] > 0) == (accum == "auto-gas2")
    assert ("grad_accum" in real["sections"]) == (accum == "in-store")
    _check(est, real)
    assert est.fits and est.activation_bytes > 0 and est.logits_bytes > 0
    text = str(est)
    for word in ("compute copy", "master", "exp_avg", "exp_avg_sq", "grad accumulator", "staging", "pinned",
                 "layer slots", "resident", "activations", "fits this machine"):
        assert word in text, word


@pytest.mark.parametrize("grad_accumulator", [True, None], ids=["in-store", "auto"])
@pytest.mark.parametrize("gas", [1, 2])
def test_estimate_of_the_accumulator_equals_wrap_after_a_step(grad_accumulator, gas):
    """``estimate(grad_accumulator=, gradient_accumulation_steps=)`` of a tiny Llama and the real ``wrap`` of the same
    model trained one step at that accumulation: the store is ``placement()["host_store_bytes"]`` exactly, the
    staging the pool's bound plus the resident unit's buffer, the accumulator (outside the store in auto mode, only
    when summing) what ``CPUAdamW`` allocated; no margin between them."""
    cfg = _llama()
    est = megatrain.estimate(cfg, device="cpu", grad_accumulator=grad_accumulator, gradient_accumulation_steps=gas)
    torch.manual_seed(0)
    model = megatrain.wrap(AutoModelForCausalLM.from_config(cfg), device="cpu", grad_accumulator=grad_accumulator)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=gas)
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    for _ in range(gas):
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    real = _real_bytes(model)
    assert est.store_bytes == model.megatrain.placement()["host_store_bytes"] == real["store"]
    assert est.staging_bytes == real["staging"] and real["staging"] > 0
    assert est.accumulator_bytes == real["accum"] and (real["accum"] > 0) == (grad_accumulator is None and gas > 1)
    assert ("grad_accum" in est.host_sections) == (grad_accumulator is True)
    assert est.host_bytes == real["store"] + real["staging"] + real["accum"] == model.megatrain.offload_plan.host_bytes \
        + real["accum"]
    model.megatrain.close()


def test_estimate_of_a_module_with_frozen_parameters_equals_wrap():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama(tied=True))
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    est = megatrain.estimate(model, device="cpu", compute_dtype=torch.bfloat16)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # not touched
    assert est.reclaimable_bytes == sum(p.numel() * 4 for p in model.parameters())
    wrapped = megatrain.wrap(model, device="cpu", compute_dtype=torch.bfloat16)
    _check(est, _real_bytes(wrapped))
    assert est.frozen_params == 96 * 32 + sum(before[n].numel() for n in before if n.startswith("model.layers.0."))
    with pytest.raises(ValueError, match="already wrapped"):
        megatrain.estimate(wrapped)


def test_unknown_keywords_with_a_module_are_refused():
    """A misspelt option (``host_memroy=``) or one ``estimate`` does not take was ignored for an ``nn.Module``
    (it goes to ``from_config`` only for a config or a directory), so the estimate judged another setting."""
    model = AutoModelForCausalLM.from_config(_llama())
    with pytest.raises(TypeError, match=r"^megatrain.estimate: unexpected keyword argument\(s\) host_memroy "):
        megatrain.estimate(model, device="cpu", host_memroy="1B")


def test_trainable_and_transform_freeze_like_from_config_does():
    cfg = _llama()

    def freeze(m):
        for n, p in m.named_parameters():
            if "mlp" in n:
                p.requires_grad_(False)
        return m

    real = _real_bytes(megatrain.from_config(cfg, seed=0, device="cpu", transform=freeze))
    assert real["frozen"] > 0
    _check(megatrain.estimate(cfg, device="cpu", transform=freeze), real)
    _check(megatrain.estimate(cfg, device="cpu", trainable=lambda name: "mlp" not in name), real)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_estimate_of_a_directory_reads_headers_only(tmp_path, monkeypatch, tied):
    from megatrain.state import loading

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_llama(tied)).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="20KB")

    def no_reads(self, key, dst):
        raise AssertionError(f"estimate read tensor {key}")

    with monkeypatch.context() as m:
        m.setattr(loading.CheckpointIndex, "read_into", no_reads)
        est = megatrain.estimate(str(tmp_path), device="cpu", compute_dtype=torch.bfloat16)
    _check(est, _real_bytes(megatrain.from_pretrained(str(tmp_path), device="cpu", compute_dtype=torch.bfloat16)))


def test_estimate_of_a_directory_missing_a_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_llama()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(megatrain.CheckpointError, match="model.layers.1.mlp.up_proj.weight is missing"):
        megatrain.estimate(str(tmp_path))


def _limits(mem_available):
    return dict(mem_available_bytes=mem_available, cgroup_limit_bytes=None, cgroup_usage_bytes=None,
                memlock_bytes=None, cgroup_path=None)


def test_fits_follows_the_budget_check(monkeypatch):
    """With MemAvailable between the store without and with the accumulator: estimate says fits at
    gradient_accumulation_steps=1 and not at 2, and the real wrap / CPUAdamW agree."""
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    cfg = _llama()
    one = megatrain.estimate(cfg, device="cpu")
    two = megatrain.estimate(cfg, device="cpu", gradient_accumulation_steps=2)
    limit = (one.host_bytes + two.host_bytes) // 2
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(limit))
    one = megatrain.estimate(cfg, device="cpu")
    two = megatrain.estimate(cfg, device="cpu", gradient_accumulation_steps=2)
    assert one.fits and one.host_available_bytes == limit
    assert not two.fits and not two.host_fits
    line = two.reason()
    assert "\n" not in line and "of host memory but only" in line and "more host RAM" in line
    assert "gradient_accumulation_steps=2 allocates the fp32 accumulator, 4 B/param more" in line
    assert "freeze the base / use LoRA" in line and "does not fit" in str(two)
    model = megatrain.from_config(cfg, seed=0, device="cpu")  # the store fits
    # CPUAdamW's accumulator check sees what is left after the store: the same shortfall.
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(limit - one.host_bytes))
    with pytest.raises(MemoryError, match="gradient accumulator"):
        megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=2)
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(one.host_bytes - 1))
    auto = megatrain.estimate(cfg, device="cpu")  # host_compute_copy="auto": the deepest layer streams from its master
    assert auto.fits and auto.master_streamed_layers == 1 and "1 master-streamed" in str(auto)
    assert not megatrain.estimate(cfg, device="cpu", host_compute_copy=True).fits
    with pytest.raises(MemoryError, match="of host memory but only"):
        megatrain.from_config(cfg, seed=0, device="cpu", host_compute_copy=True)


def test_a_host_memory_limit_too_small_is_blamed_alone():
    est = megatrain.estimate(_llama(), device="cpu", host_memory_limit=1000)
    text = str(est)
    assert not est.fits and "host_memory_limit: " in text and "DOES NOT FIT" in text.split("host_memory_limit: ")[1]
    assert all(line.endswith(": fits") for line in text.splitlines() if "available under the" in line)


def test_bad_options_are_one_line_errors():
    with pytest.raises(ValueError, match="activation_policy"):
        megatrain.estimate(_llama(), device="cpu", activation_policy="never")
    with pytest.raises(ValueError, match="grad_accumulator=False forbids it"):
        megatrain.estimate(_llama(), device="cpu", grad_accumulator=False, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="micro_batch_size must be an int >= 1"):
        megatrain.estimate(_llama(), device="cpu", micro_batch_size=0)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1"):
        megatrain.estimate(_llama(), device="cpu", seq_len=-1)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        megatrain.estimate(42)
    with pytest.raises(megatrain.CheckpointError, match="is not a local directory"):
        megatrain.estimate("/nonexistent/model")


def test_estimate_says_what_chunked_loss_and_tile_mlp_use_and_refuses_what_wrap_refuses():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=11008, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20)
    est = megatrain.estimate(cfg, device="cpu", seq_len=4096, chunked_loss=7, tile_mlp=False)
    assert (est.loss_rows, est.mlp_rows, est.norm_rows) == (7, None, None)
    assert "loss over chunks of 7 rows, no full logits (chunked_loss=7); MLP untiled (tile_mlp=false)" in str(est)
    tiled = megatrain.estimate(cfg, device="cpu", seq_len=4096, tile_mlp=9)
    assert (tiled.mlp_rows, tiled.norm_rows) == (9, 9)  # the layers' RMSNorms under the same switch
    assert "MLP over tiles of 9 rows, norms over tiles of 9 rows (tile_mlp=9)" in str(tiled)
    full = megatrain.estimate(cfg, device="cpu", seq_len=4096, chunked_loss=False)
    assert full.loss_rows is None and full.logits_bytes == 4096 * 32000 * 12 > est.logits_bytes
    moe = transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_experts=4, num_experts_per_tok=1, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(megatrain.UnsupportedModelError, match="megatrain.estimate: tile_mlp=True"):
        megatrain.estimate(moe, device="cpu", seq_len=64, tile_mlp=True)
    with pytest.raises(ValueError, match="tile_mlp must be False, True, 'auto' or a positive number of rows"):
        megatrain.estimate(cfg, device="cpu", tile_mlp=0)


def test_estimate_auto_policy_spaces_checkpoints_when_the_inputs_do_not_fit(monkeypatch):
    from megatrain.runtime.activations.long_context import checkpoint_spacing

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20)
    layer_in = 4096 * 64 * 4  # tokens x hidden x fp32
    host = megatrain.estimate(cfg, device="cpu", seq_len=4096).host_bytes  # the store must fit beside them
    free = host + int(layer_in * 6 / 0.6)  # room for 6 saved inputs of 16
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: dict(  # the CPU device's free memory
        mem_available_bytes=free, cgroup_limit_bytes=None, cgroup_usage_bytes=None, memlock_bytes=None,
        cgroup_path=None))
    est = megatrain.estimate(cfg, device="cpu", seq_len=4096, activation_policy="auto")
    k = checkpoint_spacing(16, layer_in, 0.6 * (free - est.host_bytes))  # the CPU device's memory beside the store
    assert k > 1 and est.activation_policy == f"auto (block:{k})"


def test_on_the_cpu_device_activations_and_the_store_share_host_memory(monkeypatch):
    """On the CPU device the activations live in host memory beside the store: an estimate whose store
    fits but whose store plus activations do not is refused with what to lower (it once said "fits")."""
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20)
    short = megatrain.estimate(cfg, device="cpu", seq_len=64)
    long = megatrain.estimate(cfg, device="cpu", seq_len=1 << 19)
    limit = short.host_bytes + (long.gpu_bytes + short.gpu_bytes) // 2  # room for the short run only
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(limit))
    short = megatrain.estimate(cfg, device="cpu", seq_len=64)
    long = megatrain.estimate(cfg, device="cpu", seq_len=1 << 19)
    assert short.fits and short.gpu_fits and short.gpu_free_bytes == limit - short.host_bytes
    assert long.host_fits and long.gpu_fits is False and not long.fits
    line = long.reason()
    assert "\n" not in line and "of host memory for the CPU device's slots and activations" in line
    assert "lower micro_batch_size or seq_len" in line and "DOES NOT FIT" in str(long)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the estimate for a CUDA device on a machine without one")
def test_estimate_for_cuda_counts_the_boundary_units_state_as_wrap_places_it():
    """On CUDA, wrap's default ``device_state_layers="boundary"`` keeps the resident unit's and layer
    0's fp32 state on the device: the estimate counts exactly the bytes that placement allocates
    (checked against the same placement made on the CPU backend), and nothing under ``auto``."""
    cfg = _llama()
    est = megatrain.estimate(cfg, device="cuda", compute_dtype=torch.bfloat16, seq_len=16, micro_batch_size=2,
                             activation_policy="recompute")  # (the default on CUDA is "auto")
    model = megatrain.from_config(cfg, seed=0, device="cpu", compute_dtype=torch.bfloat16,
                                  device_state_layers="boundary")
    assert est.device_state_bytes == model.megatrain.device_state.nbytes > 0
    assert est.gpu_bytes == (est.slot_bytes + est.resident_bytes + est.device_state_bytes + est.activation_bytes
                             + est.logits_bytes)
    assert "boundary units fp32 state" in str(est)
    auto = megatrain.estimate(cfg, device="cuda", compute_dtype=torch.bfloat16, activation_policy="auto")
    assert auto.device_state_bytes == 0


def test_a_directory_with_only_config_json_is_estimated_before_download(tmp_path):
    """Whether a model fits can be asked before its weights are downloaded: config.json alone is estimated,
    with the same numbers as the config object, and a note saying so."""
    _llama().save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    est = megatrain.estimate(str(tmp_path), device="cpu", seq_len=16)
    ref = megatrain.estimate(_llama(), device="cpu", seq_len=16)
    assert (est.num_params, est.host_bytes, est.gpu_bytes) == (ref.num_params, ref.host_bytes, ref.gpu_bytes)
    assert f"note: {tmp_path} holds no weights: estimated from its config.json alone" in str(est)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")  # weights, but not safetensors: as from_pretrained
    with pytest.raises(megatrain.CheckpointError, match="only safetensors checkpoints are read"):
        megatrain.estimate(str(tmp_path), device="cpu")


def test_the_estimate_names_the_device_it_checked():
    est = megatrain.estimate(_llama(), device="cpu", seq_len=16)
    assert est.device_name == "this CPU" and "float32 compute on this CPU" in str(est)


def _wide_llama(layers=8):
    return LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192)


def test_on_the_cpu_a_model_far_too_large_gets_only_advice_that_would_fit(monkeypatch):
    """A model whose compute copies alone exceed this CPU's memory (a 70B config on a small machine): the
    estimate suggests neither offload_dir (its compute copies stay in RAM) nor LoRA (the frozen model does
    not fit either), says nothing about a GPU, and plans no "chunks of 1 rows" against memory that is not there."""
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    cfg = _wide_llama()
    full = megatrain.estimate(cfg, device="cpu", seq_len=4096)
    frozen = full.host_sections["compute"]
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(frozen // 2))
    est = megatrain.estimate(cfg, device="cpu", seq_len=4096)
    text, line = str(est), est.reason()
    assert not est.fits and "\n" not in line
    assert "offload_dir" not in line and "LoRA" not in line and "GPU" not in line, line
    assert "smaller model" in line and "more host RAM" in line
    assert "chunks of 1 rows" not in text and "tiles of 1 rows" not in text
    assert est.gpu_fits is None and "this CPU's layer slots and activations" in text


def test_offload_dir_is_suggested_only_where_it_makes_the_model_fit(monkeypatch, tmp_path):
    """Host memory for the compute copies and the CPU device's batch but not for the fp32 state:
    offload_dir is suggested with the number of layers (and the host_memory_limit that leaves room for
    the CPU device's batch), and with those the model fits (with the compute copies kept: host_compute_copy=True)."""
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    cfg = _wide_llama()
    full = megatrain.estimate(cfg, device="cpu", seq_len=256, host_compute_copy=True)
    room = full.host_bytes * 3 // 4 + full.gpu_bytes
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(room))
    est = megatrain.estimate(cfg, device="cpu", seq_len=256, host_compute_copy=True)
    assert not est.fits
    line = est.reason()
    assert "or offload_dir=<a local disk> and host_memory_limit=" in line and " of 8 decoder layers" in line, line
    n = int(line.split("the fp32 state of ")[1].split(" of 8")[0])
    limit = int(line.split("host_memory_limit=")[1].split(" ")[0])
    on_disk = megatrain.estimate(cfg, device="cpu", seq_len=256, host_compute_copy=True, offload_dir=str(tmp_path), host_memory_limit=limit)
    assert on_disk.disk_layers == n and on_disk.host_fits and on_disk.gpu_fits, on_disk.reason()
    assert list(tmp_path.iterdir()) == []  # the estimate creates nothing


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("seq_len", [None, 16])
def test_the_report_of_a_tiny_model_prints_no_zero_byte_line(device, seq_len):
    """No "0 B alignment", "pinned 0 B" or "~0 B activations" line: a zero is left out or said in words
    (nothing pinned on the CPU device; activations not counted without seq_len)."""
    import re

    est = megatrain.estimate(tiny_llama_config(), device=device, seq_len=seq_len, micro_batch_size=2)
    text = str(est)
    zero = re.compile(r"(?<![\d.])0(\.0+)? (B|KiB|MiB|GiB|TiB)\b")
    assert not [line for line in text.splitlines() if zero.search(line)], text
    assert ("nothing pinned (CPU device: no DMA)" in text) == (device == "cpu")
    assert ("not counted  (pass seq_len=" in text) == (seq_len is None)


def test_host_memory_limit_above_the_compute_copies_names_what_stays_in_ram():
    """A host_memory_limit twice the compute copies that offload_dir still cannot meet (the resident unit's
    state and the gradient staging stay in host memory too): the advice does not claim that the compute
    copies alone exceed it, and says what does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    compute = megatrain.estimate(model, device="cpu").host_sections["compute"]
    est = megatrain.estimate(model, device="cpu", host_memory_limit=compute * 2)
    assert not est.fits
    line = est.reason()
    assert "compute copies alone" not in line, line
    assert "resident unit" in line and "offload_dir cannot help" in line, line


def test_a_config_field_as_a_keyword_is_refused_in_one_line_saying_where_it_goes(tmp_path):
    """Extra keywords go to the model's constructor (from_config); a config field there is refused in one line that
    says how to change the config, instead of transformers' bare TypeError."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96).save_pretrained(str(tmp_path))
    with pytest.raises(TypeError) as info:
        megatrain.estimate(str(tmp_path), device="cpu", hidden_size=64)
    msg = str(info.value)
    assert msg.startswith("megatrain.estimate: the model's constructor refused hidden_size") and "\n" not in msg
    assert "AutoConfig.from_pretrained(path, hidden_size=...)" in msg
    assert megatrain.estimate(str(tmp_path), device="cpu", attn_implementation="eager").fits  # a constructor keyword
