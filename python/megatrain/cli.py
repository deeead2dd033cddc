"""The ``megatrain`` command line.

    megatrain train                                  # the built-in default (stdlib, tiny Llama)
    megatrain train --config examples/configs/llama_small.yaml --steps 500
    megatrain train --model ./my-hf-model --data ./corpus --tokenizer ./my-hf-model --seq-len 1024
    megatrain train --set train.warmup_steps=50 --set model.num_layers=8
    megatrain train --set train.save_every=100 --out runs/a   # checkpoints in runs/a/checkpoints/
    megatrain train --resume runs/a                  # continue runs/a from its newest checkpoint
    python -m megatrain train --print-config         # the resolved configuration, as YAML
    megatrain train --preset 1b --dry-run            # the memory estimate; exit 0 (fits) or 2 (does not)

Precedence: preset (or, with --resume, the checkpoint's configuration) < --config file < explicit
flags < --set. Bad input (unknown key, missing data,
non-numeric value, sequence length above the model's limit, ...) prints one line
``megatrain: error: ...`` to stderr and exits with status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import sys
from typing import List, Optional

EXIT_USAGE = 2

# flag -> (section, key); values go through the same conversion and checks as the YAML file.
FLAG_KEYS = {
    "data": ("data", "path"),
    "tokenizer": ("data", "tokenizer"),
    "steps": ("train", "steps"),
    "lr": ("train", "lr"),
    "seq_len": ("data", "seq_len"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "gradient_accumulation_steps": ("train", "gradient_accumulation_steps"),
    "seed": ("train", "seed"),
    "out": ("log", "out"),
    "device": ("runtime", "device"),
    "compute_dtype": ("runtime", "compute_dtype"),
    "activation_policy": ("runtime", "activation_policy"),
    "chunked_loss": ("runtime", "chunked_loss"),
    "tile_mlp": ("runtime", "tile_mlp"),
    "offload_dir": ("runtime", "offload_dir"),
    "host_memory_limit": ("runtime", "host_memory_limit"),
    "gpu_memory_limit": ("runtime", "gpu_memory_limit"),
    "liger_kernel": ("runtime", "liger_kernel"),
    "host_compute_copy": ("runtime", "host_compute_copy"),
    "eval_every": ("eval", "every"),
    "log_every": ("log", "every"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        _fail(f"{message} (see `{self.prog} --help`)")


def _fail(message: str):
    sys.stderr.write(f"megatrain: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(EXIT_USAGE)


# errno -> what to do: file-system errors the user fixes (disk full, permissions, read-only mount).
_USER_ERRNOS = {
    errno.ENOSPC: "free disk space or choose another --out",
    errno.EDQUOT: "free disk quota or choose another --out",
    errno.EACCES: "check the permissions or choose another --out",
    errno.EPERM: "check the permissions or choose another --out",
    errno.EROFS: "the file system is read-only: choose another --out",
    errno.ENOENT: "a directory vanished or cannot be created there: choose another --out",
    errno.EIO: "the disk reported an I/O error: check it or choose another --out",
}


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _build_parser() -> argparse.ArgumentParser:
    from megatrain.runtime.activations.activation_policy import CHOICES as POLICY_CHOICES

    parser = _Parser(prog="megatrain", description="megatrain: train LLMs with host-resident fp32 state.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    tr = sub.add_parser(
        "train",
        help="train a causal LM (default: a tiny Llama on the Python stdlib sources)",
        description="Train a Hugging Face causal LM with megatrain. Without --config: the built-in default.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Precedence: --preset < --config < flags < --set. Keys: megatrain train --print-config.",
    )
    tr.add_argument("--config", "-c", help="YAML config file (sections model, data, train, runtime, eval, log)")
    tr.add_argument(
        "--preset",
        default="default",
        help="built-in starting point: default | gpu | 1b (1b: a 1B model streamed through one GPU; default: default)",
    )
    tr.add_argument(
        "--model",
        help="a local HF model directory (model.path) or an architecture name such as llama (model.arch)",
    )
    tr.add_argument("--data", help="text/JSONL file, directory, or 'stdlib' (data.path)")
    tr.add_argument("--tokenizer", help="local tokenizer directory, or 'byte' (data.tokenizer)")
    tr.add_argument("--steps", help="optimizer steps (train.steps)")
    tr.add_argument("--lr", help="peak learning rate (train.lr)")
    tr.add_argument("--seq-len", help="tokens per sequence (data.seq_len)")
    tr.add_argument("--micro-batch-size", help="sequences per micro batch (train.micro_batch_size)")
    tr.add_argument("--gradient-accumulation-steps", help="micro batches per step (train.gradient_accumulation_steps)")
    tr.add_argument("--seed", help="seed for init, data split and order (train.seed)")
    tr.add_argument("--out", "-o", help="output directory (log.out; default runs/<timestamp>)")
    tr.add_argument("--device", help="auto | cpu | cuda | cuda:N (runtime.device)")
    tr.add_argument("--compute-dtype", help="auto | bf16 | fp32 (runtime.compute_dtype)")
    tr.add_argument(
        "--activation-policy",
        help=f"{POLICY_CHOICES}, as megatrain.wrap (runtime.activation_policy; default: "
        "auto on CUDA, the fastest exact schedule the planner finds; recompute on the CPU)",
    )
    tr.add_argument("--gpu-memory-limit", help="GPU memory the planner may use: bytes (40GiB) or a fraction of the GPU's "
                    "memory (0.5); default all of it (runtime.gpu_memory_limit)")
    tr.add_argument("--liger-kernel", help="auto | true | false: Liger-Kernel's fused kernels, auto = when installed and "
                    "on CUDA (runtime.liger_kernel)")
    tr.add_argument("--chunked-loss", help="auto | true | false | N rows: LM head + loss over row chunks, no full "
                    "logits (runtime.chunked_loss)")
    tr.add_argument("--tile-mlp", help="auto | true | false | N rows: each layer's MLP over row tiles (runtime.tile_mlp)")
    tr.add_argument("--offload-dir", help="directory on a local disk for the fp32 state of the layers that do not fit "
                    "in host memory (runtime.offload_dir; docs/disk_tier.md)")
    tr.add_argument("--host-memory-limit", help="host bytes megatrain may use, e.g. 120GiB; the rest of the fp32 state "
                    "goes to --offload-dir (runtime.host_memory_limit)")
    tr.add_argument("--host-compute-copy", help="auto | true | false: a bf16 compute copy of each decoder layer in "
                    "host memory (false: layers stream from their fp32 master, 12 B/param; runtime.host_compute_copy)")
    tr.add_argument("--eval-every", help="steps between held-out evaluations (eval.every)")
    tr.add_argument("--log-every", help="steps between log lines (log.every)")
    tr.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set train.warmup_steps=50 (repeatable)",
    )
    tr.add_argument(
        "--resume",
        metavar="DIR",
        help="continue a run exactly: its out directory (newest checkpoint) or one checkpoint directory; its "
        "configuration is the starting point and the run's directory the output",
    )
    tr.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    tr.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    tr.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configuration, print the memory estimate (host bytes per section, pinned, GPU) and exit: "
        "0 when it fits this machine, 2 when not; builds no model and writes nothing",
    )
    sub.add_parser("info", help="build and runtime information (megatrain.info)", add_help=True)
    return parser


def _overrides(args) -> list:
    from megatrain.train.config import UsageError
    from megatrain.train.config_build import parse_override

    out = []
    if args.model is not None:
        looks_like_path = os.sep in args.model or args.model.startswith(".") or os.path.exists(args.model)
        if looks_like_path:
            out.append(("model", "path", args.model))
        else:
            out.append(("model", "arch", args.model))
    for dest, (section, key) in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out.append((section, key, value))
    if args.no_progress:
        out.append(("log", "progress", False))
    for text in args.overrides:
        out.append(parse_override(text))
    if any(not isinstance(o, tuple) or len(o) != 3 for o in out):  # pragma: no cover - our invariant
        raise UsageError("internal: bad override")
    return out


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (``timeout``, SLURM, Kubernetes) stops training like Ctrl-C does: ``summary.json``
    is written with status "interrupted". Yields a list that is non-empty once SIGTERM arrived."""
    got: list = []

    def handler(signum, frame):
        got.append(signum)
        raise KeyboardInterrupt("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_train(args) -> int:
    from megatrain.runtime.data_parallel import DataParallelError
    from megatrain.train.config import UsageError
    from megatrain.train.config_build import build_config, to_yaml
    from megatrain.train.distributed import Ranks

    stopped_by: list = []
    out_dir = None  # the run's output directory, once known
    ranks = Ranks.from_env()  # under torchrun: data parallel over its ranks (megatrain/train/distributed.py)
    try:
        resume, base = None, None
        if args.resume is not None:
            if args.preset != "default":
                raise UsageError("--preset and --resume exclude each other: a resumed run starts from its checkpoint's "
                                 "configuration")
            from megatrain.train.checkpoints import find_resume_point

            resume = find_resume_point(args.resume)
            base = resume.state["config"]
            if resume.run_dir is not None:  # continue in the run's own directory unless told otherwise
                base = {**base, "log": {**base.get("log", {}), "out": resume.run_dir}}
        cfg = build_config(args.config, preset=args.preset, overrides=_overrides(args), base=base)
        if args.print_config:
            sys.stdout.write(to_yaml(cfg, printed=True))
            return 0
        from megatrain.train import trainer
        from megatrain.train.run_plan import prepare, resolve_device

        if args.dry_run:
            return _dry_run(cfg, resume)
        if ranks.world > 1 and cfg.runtime.offload_dir is not None:
            raise UsageError("runtime.offload_dir (the disk tier) is not supported with data parallel yet; run "
                             "without torchrun, or without --offload-dir")
        ranks.init(ranks.device_for(resolve_device(cfg.runtime.device)))
        out_dir = cfg.log.out
        plan = ranks.agree(lambda: prepare(cfg, resume=resume, ranks=ranks))  # before any rank writes
        out_dir = plan.out_dir
        with _sigterm_as_interrupt() as stopped_by:
            summary = trainer.run(cfg, plan)
    except UsageError as exc:
        _fail(str(exc).replace("\n", " "))
    except FloatingPointError as exc:  # a non-finite loss / gradient (train.nonfinite=raise)
        _fail(f"{_line(exc)} (nothing non-finite reached the weights; no model was saved)")
    except MemoryError as exc:  # HostMemoryError: the store does not fit (says what to change)
        _fail(_line(exc))
    except OSError as exc:
        if exc.errno not in _USER_ERRNOS:
            raise
        where = f" {exc.filename!r}" if exc.filename else ""
        _fail(f"cannot write{where}: {exc.strerror or exc}; {_USER_ERRNOS[exc.errno]}{_what_is_kept(exc, out_dir)}")
    except KeyboardInterrupt as exc:
        sigterm = bool(stopped_by) or getattr(exc, "signum", None) == signal.SIGTERM
        how = "terminated (SIGTERM)" if sigterm else "interrupted"
        checkpoint = getattr(exc, "checkpoint", None)
        if checkpoint:
            out_dir = os.path.dirname(os.path.dirname(checkpoint))
            sys.stderr.write(f"megatrain: {how} after step {exc.step}; checkpoint {checkpoint}; continue with: "
                             f"megatrain train --resume {out_dir}\n")
        else:
            sys.stderr.write(f"megatrain: {how}; metrics so far are in the output directory, no model was saved\n")
        return 143 if sigterm else 130
    except DataParallelError as exc:  # another rank failed or died: this one stops too (its message says why)
        sys.stderr.write(f"megatrain: error: {_line(exc)}\n")
        return 1
    finally:
        ranks.close()
    from megatrain.train.metrics import summary_table
    from megatrain.train.run_summary import summary_rows

    if ranks.main:
        print(summary_table(summary_rows(summary)))
    return 0


def _what_is_kept(exc: BaseException, out_dir: Optional[str]) -> str:
    """What a failed run left in ``out_dir``, for its error line: the model saved there (when there is
    one), or that ``--out`` is as it was (a run that failed before its first step takes back its files)."""
    if not out_dir:
        return ""
    from megatrain.train.final_model import is_train_model_dir

    model = os.path.join(out_dir, "model")
    if is_train_model_dir(model):
        return f" (the model in {model} is intact)"
    if getattr(exc, "out_left_as_found", False):
        return f" ({out_dir} is left as it was)"
    return ""


def _dry_run(cfg, resume) -> int:
    """``--dry-run``: every check of a real run, the memory estimate printed; no model, nothing written."""
    from megatrain.runtime.placement.estimate import has_weight_files
    from megatrain.train.run_plan import DoesNotFit, prepare

    try:
        plan = prepare(cfg, resume=resume, dry_run=True)
    except DoesNotFit as exc:
        print(exc.estimate)
        sys.stdout.flush()
        raise
    print(plan.estimate)
    m = cfg.model.path
    print(f"the run would train on: data {cfg.data.path!r}, tokenizer {getattr(plan.data.tokenizer, 'source', None)!r}"
          + (f", model {m!r}" if m else ""))
    if m is not None and not has_weight_files(m):
        print(f"note: {m!r} holds no weights (estimated from its config.json alone): the real run needs them")
    return 0


def cmd_info(argv: List[str]) -> int:
    """``megatrain info [...]``: delegated to :func:`megatrain.info.main`."""
    try:
        from megatrain import info
    except ImportError as exc:
        _fail(f"megatrain.info is not available ({exc})")
    return int(info.main(argv) or 0)


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _join_negative_numbers(argv: List[str]) -> List[str]:
    """``--lr -1e-3`` as ``--lr=-1e-3``: argparse reads ``-1e-3`` as an option (it knows only ``-1`` and
    ``-1.5`` as negative numbers), which gave "expected one argument" instead of the value's own check."""
    out: List[str] = []
    for tok in argv:
        prev = out[-1] if out else ""
        if _NEGATIVE_NUMBER.match(tok) and prev.startswith("--") and "=" not in prev and prev != "--":
            out[-1] = f"{prev}={tok}"
        else:
            out.append(tok)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``megatrain`` console script; returns the exit status."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        parser.print_help()
        return EXIT_USAGE
    if argv[0] == "info":
        return cmd_info(argv[1:])
    args = parser.parse_args(_join_negative_numbers(argv))
    if args.command == "train":
        return cmd_train(args)
    parser.print_help()
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
