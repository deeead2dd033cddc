"""Checkpoint / resume for wrapped models: every fp32 training state, streamed unit by unit.

A checkpoint is a directory::

    manifest.json            format, model layout, sha256 + size of every other file (written last)
    unit-00000.safetensors   one file per unit (decoder layer / resident unit), fp32 tensors
    ...                      "master.<name>", "exp_avg.<name>", "exp_avg_sq.<name>" for each parameter
    state.json               optimizer hyperparameters (param groups by parameter name), per-parameter
                             Adam steps, max_grad_norm, RNG states, the caller's ``extra`` dict
    scheduler.pt             ``lr_scheduler.state_dict()`` (only when a scheduler is given)

Modules: :mod:`.manifest` (the layout, read and verified), :mod:`.save`, :mod:`.load`, :mod:`.rng`.

Unit files are standard safetensors files (``safetensors.safe_open`` reads them), written here
straight from the host store's memory (no staging copy: extra host memory is a few KiB, not a
unit) and read back straight into it (``readinto`` on the store's views). A layer whose fp32
state is in the disk tier (``wrap(offload_dir=...)``) is written from, and read into, the tier's
RAM buffer of that unit (acquired for the file, released after it): no extra RAM either. The directory is built
under a temporary name next to the destination and swapped into place only once complete
(:func:`megatrain.state.atomic.atomic_directory`), so a crash mid-save leaves the previous checkpoint
intact. Loading first verifies every file's size
and sha256 against the manifest (and refuses with :class:`CheckpointError` naming the file),
then writes the store.

Tied parameters are one host-store entry, saved once under the first name that holds them.
"""
from ..atomic import atomic_directory, check_replaceable, existing_ancestor  # noqa: F401 - public here too
from ...errors import CheckpointError  # noqa: F401 - public here too
from .load import load_checkpoint  # noqa: F401
from .manifest import FORMAT, MANIFEST, SCHEDULER, SECTIONS, STATE, VERSION  # noqa: F401
from .manifest import read_manifest, verify_checkpoint  # noqa: F401
from .save import save_checkpoint  # noqa: F401
