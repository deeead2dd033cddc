"""Markdown results tables generated from ``bench_train.py`` JSON, so the README cannot drift from its data.

For each JSON file (and, in a ``--sweep`` file, each size / tokens-per-step / depth) one block: a line
naming the machine, date, commit, model size, tokens per step and ``max_grad_norm`` recorded in the file,
then a table of every other system against megatrain's row. megatrain's row is the one its default
system produced: ``megatrain:policy=default`` if present, else ``megatrain``, else the first
``megatrain:...`` variant that ran. Each other row gives its s/step, model TFLOP/s and "megatrain is
N.NNx faster" (its s/step over megatrain's) or "slower" (megatrain's over its); a peer row
(``benchmarks/peers/``) adds the master-weight precision it keeps and whether it clipped; a row
that did not run (skipped, unavailable, out of memory, error) is listed with its status.

    python benchmarks/results_table.py --print docs/benchmarks/peers_3b_clip_h200.json
    python benchmarks/results_table.py --readme README.md docs/benchmarks/peers_3b_clip_h200.json [more.json ...]
    python benchmarks/results_table.py --readme README.md --check      # exit 1 if README's block is stale

``--readme`` replaces the text between ``<!-- results:begin -->`` and ``<!-- results:end -->``; with no
JSON named, the files linked from the current block are used again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"

# bench_train.py system name (before any ":options") -> what a reader knows it as
LABELS = {
    "megatrain": "megatrain",
    "torch_ckpt": "PyTorch on the GPU, gradient checkpointing",
    "torch_nockpt": "PyTorch on the GPU, no gradient checkpointing",
    "deepspeed_zero2": "DeepSpeed ZeRO-Offload (ZeRO-2, optimizer on the CPU)",
    "deepspeed_zero3": "DeepSpeed ZeRO-3, parameters + optimizer on the CPU",
    "fsdp2_offload": "FSDP2 with CPU offload",
    "megatrain_official": "MegaTrain's official code (github.com/DLYuanGod/MegaTrain)",
    "slideformer": "SlideFormer (github.com/RegiaYoung/SlideFormer)",
}
# a --sweep file's rows vary in this key: one block per value
SWEEP_KEY = {"size": "size", "tokens": "tokens_per_step", "depth": "layers"}


def is_megatrain(system: str) -> bool:
    """``megatrain`` or one of its ``megatrain:...`` variants (not the ``megatrain_official`` peer)."""
    return system == "megatrain" or system.startswith("megatrain:")


def pick_megatrain(rows: list) -> dict | None:
    """The row megatrain's default system produced: ``megatrain:policy=default``, else ``megatrain``, else
    the first ``megatrain:...`` variant; only rows with status ``ok``; None where none ran."""
    ok = [r for r in rows if r.get("status") == "ok" and is_megatrain(r.get("system", ""))]
    for name in ("megatrain:policy=default", "megatrain"):
        row = next((r for r in ok if r["system"] == name), None)
        if row is not None:
            return row
    return ok[0] if ok else None


def label(row: dict) -> str:
    """A reader's name for a row's system; a variant's options follow in backticks; peers add their
    master-weight precision and whether they clipped."""
    base, _, opts = row["system"].partition(":")
    text = LABELS.get(base, f"`{base}`")
    rest = [o for o in opts.split(",") if o and o != "liger=1"]
    if len(rest) < len([o for o in opts.split(",") if o]):
        text += " + Liger-Kernel"
    if rest:
        text += f" (`{','.join(rest)}`)"
    if "precision" in row:
        text += f"; {row['precision']} master weights, {'clips' if row.get('clips') else 'does not clip'}"
    loss = row.get("loss")
    if isinstance(loss, float) and loss != loss:
        text += "; its loss was NaN"
    return text


def megatrain_label(row: dict) -> str:
    """The headline row's name: ``megatrain:policy=default`` is what ``wrap(model)`` gives with no
    option (with Liger-Kernel where the run applied it); another variant keeps its system name."""
    liger = (row.get("settings") or {}).get("liger_kernel") if isinstance(row.get("settings"), dict) else None
    if row["system"] == "megatrain:policy=default":
        applied = isinstance(liger, dict) and liger.get("applied")
        return "megatrain with no options (`wrap(model)`" + (", Liger-Kernel applied)" if applied else ")")
    return f"`{row['system']}`"


def compare(row: dict, mt: dict) -> str:
    """``**1.27x** faster`` / ``**1.10x** slower``: how megatrain's s/step compares with ``row``'s."""
    if row["step_s"] >= mt["step_s"]:
        return f"**{row['step_s'] / mt['step_s']:.2f}x** faster"
    return f"**{mt['step_s'] / row['step_s']:.2f}x** slower"


def _fmt_tflops(row: dict) -> str:
    return "-" if row.get("model_tflops") is None else f"{row['model_tflops']:.1f}"


def table(rows: list) -> str:
    """Markdown table of ``rows`` (one group of a bench_train JSON) against megatrain's row.

    Raises:
        ValueError: no megatrain row ran in ``rows``.
    """
    mt = pick_megatrain(rows)
    if mt is None:
        raise ValueError(f"no megatrain row with status ok among {[r.get('system') for r in rows]}: "
                         "the table compares every system with megatrain")
    lines = [f"| {megatrain_label(mt)} ({mt['step_s']:.3f} s/step, {_fmt_tflops(mt)} TFLOP/s) compared with "
             "| s/step | model TFLOP/s | megatrain is |", "|---|---|---|---|"]
    for r in rows:
        if r is mt:
            continue
        if r.get("status") == "ok" and r.get("step_s"):
            lines.append(f"| {label(r)} | {r['step_s']:.3f} | {_fmt_tflops(r)} | {compare(r, mt)} |")
        else:
            status = str(r.get("status") or "no result").replace("|", "/").replace("\n", " ")
            lines.append(f"| {label(r)} | {status} | - | - |")
    return "\n".join(lines)


def header(doc: dict, rows: list, link: str) -> str:
    """One line: machine, date, commit, model size, tokens per step, max_grad_norm, source file."""
    m = doc.get("machine") or {}
    machine = ", ".join(filter(None, [
        doc.get("gpu"), m.get("cpu_count") and f"{m['cpu_count']} CPU cores",
        m.get("host_mem_gib") and f"{m['host_mem_gib']:.1f} GiB host memory"])) or "machine not recorded"
    when = (doc.get("date") or "date not recorded")[:10]
    first = next((r for r in rows if r.get("status") == "ok" and r.get("n_params")), rows[0])
    n = first.get("n_params")
    size = f"{n / 1e9:.2f}B-parameter" if n else "a"
    shape = ", ".join(f"{first[k]} {k}" if k == "layers" else f"{k} {first[k]}"
                      for k in ("layers", "hidden") if first.get(k))
    preset = doc.get("preset") or (doc.get("args") or {}).get("preset")
    model = f"{size} Llama" + (f" (`{preset}` preset, {shape})" if preset and not doc.get("sweep") else f" ({shape})")
    toks = f"{first.get('batch')} x {first.get('seq')}"
    if (first.get("grad_accum") or 1) > 1:
        toks += f" x {first['grad_accum']} micro-batches"
    toks += f" = {first.get('tokens_per_step')} tokens per step"
    clip = first.get("max_grad_norm")
    clip = f"`max_grad_norm={clip}`" if clip else "no gradient clipping"
    dtype = (doc.get("args") or {}).get("dtype") or next(
        (r["settings"].get("compute_dtype") for r in rows if (r.get("settings") or {}).get("compute_dtype")), None)
    dtype = f", {dtype} compute" if dtype else ""
    return (f"{machine}; {when}, commit {doc.get('git_commit') or 'not recorded'}; {model}, {toks}{dtype}, "
            f"{clip}; every system in one call ([{link}]({link})):")


def groups(doc: dict) -> list:
    """The rows of a bench_train document split into blocks: one per value of the sweep's key, else one."""
    rows = doc.get("rows") or []
    key = SWEEP_KEY.get(doc.get("sweep"))
    if key is None:
        return [rows]
    out = {}
    for r in rows:
        out.setdefault(r.get(key), []).append(r)
    return list(out.values())


def render(paths: list, link_base: str | None = None) -> str:
    """The markdown of every file in ``paths`` (bench_train JSON), blocks separated by a blank line.

    Args:
        paths: JSON files written by ``bench_train.py --out``.
        link_base: directory the links are written relative to (the README's); None: as given.

    Raises:
        ValueError: a file holds no rows, or a block has no megatrain row that ran.
        OSError / json.JSONDecodeError: a file cannot be read.
    """
    blocks = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if not doc.get("rows"):
            raise ValueError(f"{path} holds no bench_train rows: give a file written by benchmarks/bench_train.py --out")
        link = os.path.relpath(path, link_base).replace(os.sep, "/") if link_base is not None else path
        for rows in groups(doc):
            try:
                blocks.append(header(doc, rows, link) + "\n\n" + table(rows))
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
    return "\n\n".join(blocks)


def split_readme(text: str, path: str) -> tuple:
    """(before, block, after) around the results markers.

    Raises:
        ValueError: the markers are missing, repeated or out of order.
    """
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{path} needs exactly one {BEGIN} line before one {END} line around the results table")
    head, rest = text.split(BEGIN)
    block, tail = rest.split(END)
    return head + BEGIN, block.strip("\n"), END + tail


def linked_sources(block: str, base: str) -> list:
    """The JSON files a generated block links to, as paths from the current directory (in order, once each)."""
    links = re.findall(r"\]\(([^)\s]+\.json)\)", block)
    return [os.path.normpath(os.path.join(base, p)) for p in dict.fromkeys(links)]


def readme_sources(readme: str, paths: list) -> tuple:
    """(paths, base): the JSON files to render for ``readme`` (``paths``, else those its block links to) and the
    directory links are written relative to.

    Raises:
        ValueError: markers missing (see :func:`split_readme`), or no file named nor linked.
    """
    with open(readme) as f:
        block = split_readme(f.read(), readme)[1]
    base = os.path.dirname(os.path.abspath(readme))
    paths = paths or linked_sources(block, base)
    if not paths:
        raise ValueError(f"no JSON given and the results block of {readme} links to none: name the bench_train JSON files")
    return paths, base


def update_readme(readme: str, paths: list, check: bool = False) -> bool:
    """Regenerate the README's results block from ``paths`` (default: the files the block links to).

    Returns:
        True when the block was already current. With ``check`` nothing is written.

    Raises:
        ValueError: markers missing, no source named or linked, or a file unusable (see :func:`render`).
            Raised before the README is written.
    """
    paths, base = readme_sources(readme, paths)
    new = render(paths, link_base=base)
    with open(readme) as f:
        head, block, tail = split_readme(f.read(), readme)
    if new == block:
        return True
    if not check:
        with open(readme, "w") as f:
            f.write(f"{head}\n{new}\n{tail}")
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="*", help="bench_train.py output files (--readme: default the ones its block links to)")
    ap.add_argument("--readme", help="replace the text between the results markers of this file")
    ap.add_argument("--check", action="store_true", help="with --readme: write nothing, exit 1 if the block is stale")
    ap.add_argument("--print", action="store_true", dest="print_", help="print the markdown to stdout")
    args = ap.parse_args(argv)
    if not args.readme and not args.print_:
        ap.error("say what to do: --print, --readme README.md, or both")
    if args.check and not args.readme:
        ap.error("--check needs --readme")
    if not args.readme and not args.json:
        ap.error("--print needs the JSON files to render (or --readme, to render the files its block links to)")
    try:
        if args.print_:
            paths, base = readme_sources(args.readme, args.json) if args.readme else (args.json, None)
            print(render(paths, link_base=base))
        if args.readme:
            current = update_readme(args.readme, args.json, check=args.check)
            if args.check and not current:
                print(f"{args.readme}: the results block differs from its JSON; run "
                      f"python benchmarks/results_table.py --readme {args.readme}", file=sys.stderr)
                return 1
    except (OSError, ValueError) as e:
        print(f"results_table: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
