"""Comparing written tensors with their source, tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lightrft.strategy.checkpoint.layout import CheckpointError


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bits, not equal values (NaN == NaN, -0.0 != 0.0)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def _max_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest absolute difference; inf where one side is NaN or an infinity the
    other does not match."""
    a, e = actual.double(), expected.double()
    diff = (a - e).abs()
    both_nan = a.isnan() & e.isnan()
    same_inf = a.isinf() & (a == e)
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff)
    return float(diff.max().item())


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
            same = torch.equal(_bits(actual), _bits(expected))
            diff = 0.0 if same else _max_difference(actual, expected)
            self.max_abs_diff = max(self.max_abs_diff, diff)
            if not same and diff == 0:
                self.problems.append(f"{name}: equal values, different bits (-0.0 for 0.0?)")
            elif not same:
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
                "kept. A missing or extra tensor means the source holds state this command "
                "cannot carry (please report it); a difference, that the disk did not keep "
                "what was written (check its space and errors) and run the command again"
            )

    def summary(self) -> str:
        return f"verified {self.compared} tensors, max abs diff {self.max_abs_diff:.3g}"
