"""What a training step consumes: microbatches of token ids and their targets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # target id of padding, excluded from the loss


@dataclass
class Microbatch:
    """Inputs and targets, both [b, s] int64; targets == -100 are padding."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def tokens(self) -> int:
        return int((self.targets != IGNORE).sum())
