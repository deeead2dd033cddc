"""examples/notebook.ipynb runs top to bottom on CPU: progress bar, inline loss plot, saved model."""

from __future__ import annotations

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
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
               or "training" in o.get("text", "") for o in outputs), "no progress bar output"
    text = "".join(o.get("text", "") for o in outputs)
    first, last = [float(v) for v in text.split("loss ", 1)[1].split("\n", 1)[0].split(" -> ")]
    assert last < first
    assert os.path.isfile(tmp_path / "notebook_out" / "checkpoint" / "manifest.json")
    assert os.path.isfile(tmp_path / "notebook_out" / "model" / "model.safetensors")
