"""Built-in presets of ``megatrain train``: the names this module has always offered.

The presets themselves are :data:`megatrain.train.presets.PRESETS`; :func:`preset_dict` (in
:mod:`megatrain.train.config`, next to the ``Config`` it starts from) merges one over the defaults.
"""

from megatrain.train.config import preset_dict
from megatrain.train.presets import PRESETS

__all__ = ["PRESETS", "preset_dict"]
