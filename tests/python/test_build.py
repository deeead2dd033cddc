"""The built extension shares torch's C++ runtime (no static copy of libstdc++ inside _C) and, in a source tree, matches csrc/."""
import shutil
import subprocess

import pytest

import megatrain._C as C


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_extension_links_the_shared_libstdcxx():
    # A static libstdc++ copy in _C crashed the process on the H200 machine the first time an
    # error message formatted a number (two std::locale worlds in one process).
    dyn = subprocess.run(["readelf", "-d", C.__file__], capture_output=True, text=True, check=True).stdout
    assert "libstdc++.so" in dyn, f"{C.__file__} does not link libstdc++ dynamically:\n{dyn}"
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", C.__file__], capture_output=True, text=True, check=True).stdout
    own = [ln for ln in syms.splitlines() if "_ZNSo9_M_insert" in ln and " UND " not in ln]
    assert not own, "the extension defines libstdc++'s std::ostream internals itself:\n" + "\n".join(own[:5])


def test_error_message_with_numbers_after_many_ops():
    # The crash needed a formatted integer in the message; run it after the op has run.
    import torch
    import megatrain.ops as ops
    p, m, v = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        ops.adamw_step_(p, m, v, torch.ones(64), None, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="must have 64"):
        ops.adamw_step_(p, m, torch.zeros(63), torch.ones(64), None, lr=1e-3, step=1)


def _source_tree(tmp_path, csrc_sha256):
    """A copy of this package in a source-tree layout (python/megatrain next to csrc/ and setup.py; the compiled
    extensions linked, not copied) whose _build_info.json records ``csrc_sha256`` (None: not recorded)."""
    import json
    import os
    import shutil
    from pathlib import Path

    import megatrain

    pkg = Path(megatrain.__file__).parent
    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "csrc", tmp_path / "csrc")
    (tmp_path / "setup.py").write_text("")
    dst = tmp_path / "python" / "megatrain"
    shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__", "_build_info.json"))
    for so in pkg.glob("*.so"):
        os.symlink(so, dst / so.name)
    info = json.loads((pkg / "_build_info.json").read_text()) if (pkg / "_build_info.json").exists() else {}
    info.pop("csrc_sha256", None)
    if csrc_sha256 is not None:
        info["csrc_sha256"] = csrc_sha256
    (dst / "_build_info.json").write_text(json.dumps(info))
    return tmp_path


def _import_megatrain(root):
    import os
    import sys

    env = dict(os.environ, PYTHONPATH=str(root / "python"))
    code = "import megatrain, megatrain._ext; print(megatrain.__file__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(root))


def test_import_from_a_source_tree_refuses_an_extension_built_from_other_csrc(tmp_path):
    from pathlib import Path

    from megatrain._source_hash import csrc_hash

    repo = Path(__file__).resolve().parents[2]
    root = _source_tree(tmp_path, csrc_hash(repo / "csrc"))
    ok = _import_megatrain(root)  # the same sources (an extension copied from another checkout): imports
    assert ok.returncode == 0 and ok.stdout.strip().startswith(str(root)), ok.stderr
    header = sorted((root / "csrc").rglob("*.h"))[0]
    header.write_text(header.read_text() + "\n// changed\n")  # C++ edited, no rebuild
    bad = _import_megatrain(root)
    assert bad.returncode != 0
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: megatrain's compiled extension was built from other C++ sources (built "
                           f"{csrc_hash(repo / 'csrc')[:12]}"), bad.stderr
    assert f"tree {csrc_hash(root / 'csrc')[:12]}" in last and "python setup.py build_ext --inplace" in last
    (root / "setup.py").unlink()
    import shutil

    shutil.rmtree(root / "csrc")  # an installed package (no sources next to it): never checked
    assert _import_megatrain(root).returncode == 0


def test_source_hash_check_is_cheap_and_skips_builds_without_a_recorded_hash(tmp_path):
    import time
    from pathlib import Path

    from megatrain._source_hash import check_source_tree

    root = _source_tree(tmp_path, None)
    pkg = root / "python" / "megatrain"
    check_source_tree(pkg, pkg / "_build_info.json")  # an older build: nothing recorded, nothing checked
    (pkg / "_build_info.json").write_text('{"csrc_sha256": "0000"}')
    t = time.perf_counter()
    with pytest.raises(ImportError, match="built 0000 at git unknown"):
        check_source_tree(pkg, pkg / "_build_info.json")
    assert time.perf_counter() - t < 0.05
    assert Path(root / "csrc").is_dir()
