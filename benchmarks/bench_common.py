"""What every benchmark records about the tree it ran (shared by the bench_*.py scripts)."""
import os
import subprocess


def git_commit() -> str | None:
    """HEAD (+ "-dirty"), or ``$MEGATRAIN_GIT_COMMIT`` when set (a copied tree whose ``.git`` is stale,
    e.g. the device machine's copy); None when neither is known."""
    if os.environ.get("MEGATRAIN_GIT_COMMIT"):
        return os.environ["MEGATRAIN_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return c + ("-dirty" if dirty else "") if c else None
    except OSError:
        return None
