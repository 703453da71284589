"""The loss tokens a Ulysses forward is asked to keep: the language-model head on each
rank's own slice of the sequence instead of every rank's rows gathered whole.

:func:`lightrft.strategy.packing.token_logprobs` fills a :class:`LossTokens` with the
loss positions of every rank of the sequence-parallel group and runs the forward inside
:func:`loss_tokens_only`; the decoder's hook (:mod:`lightrft.strategy.ulysses`) then
returns, as the hidden states, this rank's slice at the group's loss positions only
(:func:`owned_positions`), and ``token_logprobs`` gathers the per-token
log-probabilities (one number per token, not ``hidden``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["LossTokens", "loss_tokens_only", "owned_positions", "requested"]


@dataclass
class LossTokens:
    """What :func:`loss_tokens_only` asks of a forward: the loss tokens of every rank of
    the group, as ``(rows, columns)`` of the positions predicting them in each rank's
    own batch (every rank passes ``rows_per_rank`` rows). The decoder's hook fills in
    the rest: the group's loss tokens in one list (rank by rank; once when the ranks
    hold the same rows), which of them this rank computes (``owned``: their positions
    fall in its slice of the sequence) and where its own are (``mine``)."""

    per_rank: list[tuple[list[int], list[int]]]
    rows_per_rank: int
    total: int = 0
    owned: torch.Tensor | None = None
    mine: torch.Tensor | None = None


_LOSS_TOKENS: ContextVar[LossTokens | None] = ContextVar("lightrft_loss_tokens", default=None)


@contextmanager
def loss_tokens_only(request: LossTokens) -> Iterator[LossTokens]:
    """Forwards inside return, as the decoder's hidden states, ``[1, owned, hidden]``:
    this rank's slice of the sequence at the group's loss positions only, not every
    rank's rows gathered whole. The language-model head then runs on each rank's own
    share of the group's loss tokens (see
    :func:`lightrft.strategy.packing.token_logprobs`, which gathers the
    log-probabilities instead of the hidden states)."""
    token = _LOSS_TOKENS.set(request)
    try:
        yield request
    finally:
        _LOSS_TOKENS.reset(token)


def requested() -> LossTokens | None:
    """The request of the :func:`loss_tokens_only` block running, if any."""
    return _LOSS_TOKENS.get()


def owned_positions(
    hidden: torch.Tensor, rank: int, size: int, padded: int, replicated: bool, request: LossTokens
) -> torch.Tensor:
    """``hidden`` ([pooled rows, padded / size, hidden]: rank ``rank``'s slice of the
    group's rows, ``padded`` tokens long) at this rank's share of the loss positions, as
    ``[1, owned, hidden]``; fills ``request``'s indices. ``replicated``: every rank of
    the group holds the same rows."""
    chunk = padded // size
    start = rank * chunk
    if replicated:  # every rank holds the same rows: their loss tokens once
        lists, offsets, mine_from = request.per_rank[:1], [0], 0
    else:
        lists = request.per_rank
        offsets = [r * request.rows_per_rank for r in range(len(lists))]
        mine_from = sum(len(rows) for rows, _ in lists[:rank])
    rows = torch.tensor(
        [row + offset for (r, _), offset in zip(lists, offsets, strict=True) for row in r],
        dtype=torch.long,
    )
    columns = torch.tensor([c for _, cols in lists for c in cols], dtype=torch.long)
    request.total = int(rows.numel())
    count = len(request.per_rank[rank][0])
    request.mine = torch.arange(mine_from, mine_from + count)
    owned = ((columns >= start) & (columns < start + chunk)).nonzero().flatten()
    request.owned = owned
    device = hidden.device
    return hidden[rows[owned].to(device), (columns[owned] - start).to(device)].unsqueeze(0)
