"""Built-in presets of ``megatrain train``: the names this module has always offered.

The presets themselves are :data:`megatrain.train.presets.PRESETS`; :func:`preset_dict` (in
:mod:`megatrain.train.config_build`, beside the merging of the other sources) merges one over the defaults.
"""

from megatrain.train.config_build import preset_dict
from megatrain.train.presets import PRESETS

__all__ = ["PRESETS", "preset_dict"]
