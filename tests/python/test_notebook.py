"""examples/notebook.ipynb runs top to bottom on CPU: live progress (an ipywidgets display, or text
lines without ipywidgets), inline plots, saved checkpoint and model."""

from __future__ import annotations

import importlib.util
import os

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "notebook.ipynb")


def _kernel_or_skip():
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (pip install nbclient)")
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

        KernelSpecManager().get_kernel_spec("python3")
    except (ImportError, NoSuchKernel):
        pytest.skip("needs an ipykernel 'python3' kernel (pip install ipykernel)")
    return nbformat, nbclient


def test_notebook_executes(tmp_path):
    nbformat, nbclient = _kernel_or_skip()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ, MEGATRAIN_NOTEBOOK_STEPS="40", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2",
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no inline plot"
    text = "".join(o.get("text", "") for o in outputs)
    widget_views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    if importlib.util.find_spec("ipywidgets") is not None:  # the kernel sees the same packages
        assert widget_views, "no live progress widget"
        assert "training: step" not in text
    else:
        assert not widget_views
        assert "pip install ipywidgets" in text
        lines = [ln for ln in text.splitlines() if ln.startswith("training: step")]
        assert [ln.split()[2] for ln in lines] == ["10/40", "20/40", "30/40", "40/40"], lines
        assert all(" | loss " in ln and "tokens/s" in ln for ln in lines)
    assert "bytes/parameter" in text
    summary = [ln for ln in text.splitlines() if ln.startswith("loss ") and " -> " in ln]
    first, last = [float(v) for v in summary[0][len("loss "):].split(" -> ")]
    assert last < first
    assert os.path.isfile(tmp_path / "notebook_out" / "checkpoint" / "manifest.json")
    assert os.path.isfile(tmp_path / "notebook_out" / "model" / "model.safetensors")


def test_notebook_is_committed_without_outputs():
    """Executed cells (images, widget state, local paths) stay out of the repository."""
    import json

    with open(NOTEBOOK) as f:
        nb = json.load(f)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    assert "widgets" not in nb.get("metadata", {})
