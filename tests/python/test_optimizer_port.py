"""The optimizer and the engine talk through one module, both ways (runtime/engine/optimizer_port.py).

``CPUAdamW`` reaches the engine only through an ``OptimizerPort``; the port uses only the engine's
public members; the engine calls back through the ``EngineOptimizer`` protocol defined beside it.
"""

import ast
import inspect
from pathlib import Path

import torch

import megatrain
from megatrain.runtime.engine import core, optimizer_port
from megatrain.runtime.engine.optimizer_port import EngineOptimizer, GradView, OptimizerPort
from megatrain.runtime.engine.units import Unit

PACKAGE = Path(megatrain.__file__).resolve().parent
# what the optimizer may read of a unit / entry itself: what they are, not where their state is
UNIT_DESCRIPTION = {"index", "kind", "entries", "name", "frozen", "shape", "numel"}


def _wrapped(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96)
    return megatrain.wrap(LlamaForCausalLM(cfg), device="cpu", compute_dtype=torch.float32, **kw)


def _public(names):
    return {n for n in names if not n.startswith("_")}


def _attributes(path: Path):
    """``(line, value source, attribute)`` of every attribute access in the file."""
    tree = ast.parse(path.read_text(), str(path))
    return [(n.lineno, ast.unparse(n.value), n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)]


def test_the_optimizer_reaches_the_engine_only_through_its_port():
    model = _wrapped()
    eng = model.megatrain
    unit = eng.units[0]
    engine_members = _public(dir(type(eng))) | _public(vars(eng))
    ledger_members = _public(dir(type(unit))) | _public(vars(unit))  # a unit's gradient ledger and placement
    allowed = (_public(dir(OptimizerPort)) | set(GradView._fields) | _public(dir(torch.optim.Optimizer))
               | UNIT_DESCRIPTION)
    forbidden = (engine_members | ledger_members) - allowed
    found = [f"{p.name}:{line}: {value}.{attr}" for p in sorted((PACKAGE / "optim").glob("*.py"))
             for line, value, attr in _attributes(p) if attr in forbidden and not value.startswith("self._port")]
    assert not found, ("megatrain.optim reads the engine (or a unit's state) outside its OptimizerPort:\n"
                       + "\n".join(found))
    imports = set()
    for p in (PACKAGE / "optim").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("runtime"):
                imports |= {f"{node.module}.{a.name}" for a in node.names}
    assert imports <= {"runtime.engine.optimizer_port.OptimizerPort", "runtime.engine.optimizer_port.GradView",
                       "runtime.engine.optimizer_port.MOMENTS", "runtime.engine.core.locate",
                       "runtime.data_parallel.calls.fingerprint"}, imports


def test_the_port_uses_only_the_engines_public_members():
    model = _wrapped()
    eng = model.megatrain
    used = [(line, attr) for line, value, attr in _attributes(Path(optimizer_port.__file__))
            if value == "self._engine"]
    assert used, "the port reaches the engine as self._engine"
    private = [f"line {line}: {attr}" for line, attr in used if attr.startswith("_")]
    assert not private, private
    missing = [attr for _, attr in used if attr != "dp" and not hasattr(eng, attr)]  # dp: data parallel only
    assert not missing, missing


def test_the_engine_and_its_optimizer_share_one_protocol():
    assert core.EngineOptimizer is EngineOptimizer  # the engine's annotations name the port module's protocol
    model = _wrapped()
    opt = megatrain.optim.CPUAdamW(model.parameters(), max_grad_norm=1.0)
    assert model.megatrain.optimizer is opt and opt.engine is model.megatrain
    for name in EngineOptimizer.__annotations__:
        assert hasattr(opt, name), name
    for name, fn in inspect.getmembers(EngineOptimizer, inspect.isfunction):
        if not name.startswith("_"):
            assert list(inspect.signature(getattr(opt, name)).parameters) == \
                list(inspect.signature(fn).parameters)[1:], name


def test_the_port_reads_the_gradients_and_moments_of_each_unit():
    model = _wrapped()
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), max_grad_norm=1.0)  # updates wait for step()
    port = OptimizerPort(eng)
    assert port.serves(eng) and port.optimizer is opt and port.units == eng.units
    x = torch.randint(0, 96, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    views = port.wait_grads()
    assert list(views) == [u.index for u in eng.units]
    for u in eng.units:
        v = views[u.index]
        assert isinstance(v, GradView) and len(v.has_grad) == len(u.entries)
        assert all(v.has_grad) and not any(v.eager)
        assert all(s > 0 and s == s for s in v.grad_sq)
    opt.step()
    opt.wait()
    views = port.wait_grads()
    assert not any(any(v.has_grad) for v in views.values())
    unit, p = eng.units[0], next(iter(eng.units[0].entries)).param
    view = port.state_view(unit, 0, "exp_avg")
    assert view.shape == p.shape and view.dtype == torch.float32
    assert view.data_ptr() == opt.state[p]["exp_avg"].data_ptr()  # optimizer.state[p] is the store's view
    assert bool(view.abs().sum() > 0)  # the step wrote it


def test_the_port_places_units_as_the_engine_does():
    model = _wrapped(device_state_layers=1)
    eng = model.megatrain
    port = OptimizerPort(eng)
    on_device = [port.state_on_device(u) for u in eng.units]
    assert on_device == [u.device_state is not None for u in eng.units] and any(on_device) and not all(on_device)
    assert not any(port.on_disk(u) for u in eng.units)  # no offload_dir
    assert all(isinstance(u, Unit) for u in port.units)
