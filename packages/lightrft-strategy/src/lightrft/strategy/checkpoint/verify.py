"""Comparing written tensors with their source, tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lightrft.strategy.checkpoint.layout import CheckpointError


class VerificationError(CheckpointError):
    """What was written does not read back as its source."""


@dataclass
class Verification:
    """How many tensors were read back and compared, and the largest difference."""

    compared: int = 0
    max_abs_diff: float = 0.0
    problems: list[str] = field(default_factory=list)

    def check(self, name: str, expected: torch.Tensor, actual: torch.Tensor | None) -> None:
        self.compared += 1
        if actual is None:
            self.problems.append(f"{name}: missing from the output")
            return
        if tuple(actual.shape) != tuple(expected.shape) or actual.dtype != expected.dtype:
            self.problems.append(
                f"{name}: wrote {tuple(actual.shape)} {actual.dtype}, expected "
                f"{tuple(expected.shape)} {expected.dtype}"
            )
            return
        if expected.numel():
            diff = (actual.double() - expected.double()).abs().max().item()
            if diff != diff:  # NaN in one and not the other (or both: compare masks)
                same = torch.equal(actual.isnan(), expected.isnan())
                diff = 0.0 if same else float("inf")
            self.max_abs_diff = max(self.max_abs_diff, diff)
            if diff > 0:
                self.problems.append(f"{name}: differs by up to {diff:.3g}")

    def extra(self, names: Iterable[str]) -> None:
        for name in names:
            self.problems.append(f"{name}: in the output but not in the source")

    def raise_if_failed(self, what: str) -> None:
        if self.problems:
            shown = "; ".join(self.problems[:10])
            more = f" (and {len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
            raise VerificationError(
                f"{what} did not read back as its source: {shown}{more}. The output was not "
                "kept; check the disk (space, errors) and run the command again"
            )

    def summary(self) -> str:
        return f"verified {self.compared} tensors, max abs diff {self.max_abs_diff:.3g}"
