"""``ActivationPolicy``: ``wrap``'s ``activation_policy`` string, parsed once into a typed value.

The string stays the user's form (``"recompute"``, ``"store"``, ``"auto"``, ``"offload"``,
``"block:K"``): ``str(policy)`` gives it back exactly as written, so metrics, ``summary.json``,
``model.megatrain.activation_policy`` and messages read as before. Code asks the value its
questions (:attr:`ActivationPolicy.recomputes`, :attr:`ActivationPolicy.is_auto`, ...) instead of
comparing strings. The rules each policy follows are in :mod:`.policies`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

# The one list of policies: the parser, its message, the CLI's help and the metrics' recompute FLOPs read these.
KINDS = ("recompute", "store", "auto", "offload", "block")
RECOMPUTING_KINDS = ("recompute", "offload", "block")  # backward re-runs each layer's forward (metrics count it)

_SPELLED = ["block:K" if k == "block" else k for k in KINDS]
ACCEPTED = ", ".join(f"'{k}'" for k in _SPELLED[:-1]) + f" or '{_SPELLED[-1]}' (K >= 1)"  # for messages
CHOICES = " | ".join(_SPELLED)  # for help texts: recompute | store | auto | offload | block:K
_POLICY_RE = re.compile("|".join(r"block:(\d+)" if k == "block" else re.escape(k) for k in KINDS))


@dataclass(frozen=True)
class ActivationPolicy:
    """Which layer inputs / graphs a forward keeps for backward (``megatrain.wrap(activation_policy=)``).

    Attributes:
        kind: ``"recompute"`` (keep each layer's input), ``"store"`` (keep every layer's graph),
            ``"auto"`` (the planner decides per input shape), ``"offload"`` (as recompute, the inputs
            parked in pinned host memory) or ``"block"`` (keep every K-th input).
        block_k: K of ``block:K`` (>= 1); 1 for the other kinds.
        text: the string form as the user wrote it (``"block:04"`` stays so); default: the canonical one.
    """

    kind: str
    block_k: int = 1
    text: str = field(default="", compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS or isinstance(self.block_k, bool) or not isinstance(self.block_k, int) \
                or self.block_k < 1 or (self.kind != "block" and self.block_k != 1):
            raise ValueError(f"ActivationPolicy: kind must be one of {KINDS} and block_k an int >= 1 (1 unless kind is "
                             f"'block'), got kind={self.kind!r}, block_k={self.block_k!r}")
        if not self.text:
            object.__setattr__(self, "text", f"block:{self.block_k}" if self.kind == "block" else self.kind)

    @classmethod
    def parse(cls, policy, what: str = "megatrain.wrap: activation_policy") -> "ActivationPolicy":
        """The policy ``policy`` names (an :class:`ActivationPolicy` is returned as it is).

        Args:
            policy: ``"recompute"``, ``"store"``, ``"auto"``, ``"offload"`` or ``"block:K"`` with K >= 1.
            what: how the error message names the value (``runtime.activation_policy`` in the CLI).

        Raises:
            ValueError: ``policy`` is anything else; the message names the accepted values and ``policy``.
        """
        if isinstance(policy, cls):
            return policy
        m = _POLICY_RE.fullmatch(policy) if isinstance(policy, str) else None
        if m is None or (m.group(1) is not None and int(m.group(1)) < 1):
            raise ValueError(f"{what} must be {ACCEPTED}, got {policy!r}")
        if m.group(1) is not None:
            return cls("block", int(m.group(1)), policy)
        return cls(policy)

    @classmethod
    def default(cls, device) -> "ActivationPolicy":
        """The policy when none is given (``wrap``, ``from_pretrained``, ``from_config``, ``estimate``,
        ``megatrain train``): ``auto`` on a CUDA device (the placement planner, docs/placement.md),
        ``recompute`` on the CPU backend (:func:`.policies.default_activation_policy` gives its string)."""
        return cls("auto" if torch.device(device).type == "cuda" else "recompute")

    @classmethod
    def block(cls, k: int) -> "ActivationPolicy":
        """``block:K``: one saved layer input of every ``k``."""
        return cls("block", k)

    def __str__(self) -> str:
        return self.text

    @property
    def is_auto(self) -> bool:
        """``auto``: the planner decides per input shape (and places the device-state layers)."""
        return self.kind == "auto"

    @property
    def stores(self) -> bool:
        """``store``: every layer keeps its graph; backward re-streams only the weights."""
        return self.kind == "store"

    @property
    def offloads(self) -> bool:
        """``offload``: the saved layer inputs are parked in pinned host memory."""
        return self.kind == "offload"

    @property
    def is_block(self) -> bool:
        """``block:K`` (any K, 1 included)."""
        return self.kind == "block"

    @property
    def recomputes(self) -> bool:
        """Whether backward re-runs each layer's forward (``recompute``, ``offload``, ``block:K``):
        the FLOPs counted as recompute in the metrics. ``auto`` decides at run time: False here."""
        return self.kind in RECOMPUTING_KINDS
