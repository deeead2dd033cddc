"""benchmarks/results_table.py: the README's results table is the one its bench_train JSON gives."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import results_table  # noqa: E402


def _row(system, step_s=None, status="ok", **extra):
    row = dict(system=system, status=status, batch=2, seq=1024, layers=8, hidden=512, grad_accum=1,
               max_grad_norm=None, tokens_per_step=2048, **extra)
    if step_s is not None:
        row.update(step_s=step_s, model_tflops=100.0 / step_s, n_params=123_000_000)
    return row


def _doc(rows):
    return dict(benchmark="bench_train", sweep=None, date="2026-12-05T10:00:00+00:00", gpu="NVIDIA H200",
                machine=dict(cpu_count=16, host_mem_gib=125.85), git_commit="abc1234", preset="tiny",
                args=dict(preset="tiny", dtype="bf16", max_grad_norm=None), rows=rows)


def test_readme_block_is_exactly_what_its_json_gives():
    readme = os.path.join(ROOT, "README.md")
    with open(readme) as f:
        block = results_table.split_readme(f.read(), readme)[1]
    sources = results_table.linked_sources(block, ROOT)
    assert os.path.join(ROOT, "docs", "benchmarks", "peers_3b_clip_h200.json") in sources
    assert results_table.render(sources, link_base=ROOT) == block, \
        "README.md's results block differs from its JSON: run python benchmarks/results_table.py --readme README.md"
    # the numbers the hand-written table had
    for cell in ("0.910 s/step", "| 1.152 |", "**1.27x** faster", "| 2.527 |", "**2.78x** faster", "| 2.636 |",
                 "**2.90x** faster", "| 3.981 |", "**4.37x** faster", "commit c49d91e", "2026-12-01",
                 "16384 tokens per step", "`max_grad_norm=1.0`", "3.37B-parameter"):
        assert cell in block, cell


def test_synthetic_rows_render_default_system_peers_skips_and_both_directions(tmp_path):
    rows = [
        _row("megatrain_official", 2.0, precision="bf16", clips=False),  # a peer named megatrain*: not the baseline
        _row("megatrain", 1.2),                                          # a variant, not the default system
        _row("megatrain:policy=default", 1.0),                           # the baseline
        _row("torch_nockpt", 0.8),                                       # faster than megatrain
        _row("torch_ckpt", 1.5),                                         # slower
        _row("slideformer", status="skipped: SlideFormer source not found at .peers/slideformer"),
    ]
    path = tmp_path / "synthetic.json"
    path.write_text(json.dumps(_doc(rows)))
    out = results_table.render([str(path)], link_base=str(tmp_path))
    lines = out.splitlines()
    assert lines[0] == ("NVIDIA H200, 16 CPU cores, 125.8 GiB host memory; 2026-12-05, commit abc1234; "
                        "0.12B-parameter Llama (`tiny` preset, 8 layers, hidden 512), 2 x 1024 = 2048 tokens per step, "
                        "bf16 compute, no gradient clipping; every system in one call ([synthetic.json](synthetic.json)):")
    assert lines[2] == "| megatrain with no options (`wrap(model)`) (1.000 s/step, 100.0 TFLOP/s) compared with | s/step | model TFLOP/s | megatrain is |"
    assert lines[4:] == [
        "| MegaTrain's official code (github.com/DLYuanGod/MegaTrain); bf16 master weights, does not clip "
        "| 2.000 | 50.0 | **2.00x** faster |",
        "| megatrain | 1.200 | 83.3 | **1.20x** faster |",
        "| PyTorch on the GPU, no gradient checkpointing | 0.800 | 125.0 | **1.25x** slower |",
        "| PyTorch on the GPU, gradient checkpointing | 1.500 | 66.7 | **1.50x** faster |",
        "| SlideFormer (github.com/RegiaYoung/SlideFormer) | skipped: SlideFormer source not found at .peers/slideformer | - | - |",
    ]


def test_without_the_default_system_plain_megatrain_is_the_baseline(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(_doc([_row("megatrain:policy=store", 0.9), _row("megatrain", 1.1),
                                     _row("torch_ckpt", 1.1)])))
    out = results_table.render([str(path)])
    assert "| `megatrain` (1.100 s/step" in out and "| megatrain (`policy=store`) | 0.900 |" in out


def test_readme_update_replaces_only_the_marked_block_and_check_reports_staleness(tmp_path):
    src = tmp_path / "docs" / "r.json"
    src.parent.mkdir()
    src.write_text(json.dumps(_doc([_row("megatrain", 1.0), _row("fsdp2_offload", 3.0)])))
    readme = tmp_path / "README.md"
    readme.write_text("# t\n\nbefore\n<!-- results:begin -->\nold table\n<!-- results:end -->\n\nafter\n")
    assert results_table.main(["--readme", str(readme), "--check", str(src)]) == 1
    assert "old table" in readme.read_text()  # --check writes nothing
    assert results_table.main(["--readme", str(readme), str(src)]) == 0
    text = readme.read_text()
    assert text.startswith("# t\n\nbefore\n<!-- results:begin -->\nNVIDIA H200") and text.endswith(
        "| FSDP2 with CPU offload | 3.000 | 33.3 | **3.00x** faster |\n<!-- results:end -->\n\nafter\n")
    assert "([docs/r.json](docs/r.json))" in text
    # later runs find the JSON from the block's own link
    assert results_table.main(["--readme", str(readme), "--check"]) == 0


def test_bad_inputs_give_one_line_and_write_nothing(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    src = tmp_path / "r.json"
    src.write_text(json.dumps(_doc([_row("torch_ckpt", 1.0)])))
    assert results_table.main(["--readme", str(readme), str(src)]) == 2
    assert "needs exactly one <!-- results:begin -->" in capsys.readouterr().err
    readme.write_text("<!-- results:begin -->\nx\n<!-- results:end -->\n")
    assert results_table.main(["--readme", str(readme), str(src)]) == 2
    err = capsys.readouterr().err
    assert "no megatrain row with status ok" in err and err.count("\n") == 1
    assert readme.read_text() == "<!-- results:begin -->\nx\n<!-- results:end -->\n"
    with pytest.raises(SystemExit):
        results_table.main(["--print"])


def test_a_size_sweep_gives_one_block_per_size(tmp_path):
    rows = [dict(_row("megatrain", 1.0), size="1b"), dict(_row("torch_ckpt", 2.0), size="1b"),
            dict(_row("megatrain", 3.0), size="7b"), dict(_row("torch_ckpt", status="oom"), size="7b")]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(dict(_doc(rows), sweep="size")))
    blocks = results_table.render([str(path)]).split("\n\n")
    assert len(blocks) == 4  # header + table per size
    assert "**2.00x** faster" in blocks[1] and "| PyTorch on the GPU, gradient checkpointing | oom | - | - |" in blocks[3]
    assert "(1.000 s/step" in blocks[1] and "(3.000 s/step" in blocks[3]
