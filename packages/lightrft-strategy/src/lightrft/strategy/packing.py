"""Micro-batches as the model takes them: samples packed into one row, or padded rows.

A sample is a prompt and a completion (token ids); its **loss tokens** are the
completion's, each predicted from the position before it. :func:`build_batch` lays a
micro-batch's samples out:

* **packed** (``packing_samples``): one row ``[1, total]``, each sample with its own
  position ids restarting at 0, no attention mask and no KV cache. That is the packed
  format of transformers (``masking_utils.find_packed_sequence_indices``): with SDPA or eager
  attention each token attends causally within its own sample only, with
  flash-attention the samples run as variable-length sequences, and the strategy's
  Ulysses sequence parallelism builds the same per-sample mask over the whole row.
  Upstream LightRFT's packed actor forward passes the same (``reset_position_ids``,
  ``attention_mask=None``);
* **padded**: one right-padded row per sample with its attention mask.

:func:`token_logprobs` runs the model and returns the log-probability of every loss
token, flat, in sample order; with a Hugging Face causal LM it asks for the logits of
those positions only (``logits_to_keep``), so the language-model head does not run over
the prompts or the padding. :meth:`TrainBatch.split` and :meth:`TrainBatch.to_rows`
give per-token values back per sample, or in the trainer's ``[samples, width]`` shape.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.strategy import loss_tokens, ulysses
from lightrft.strategy.actor import unwrap_model

__all__ = ["Sample", "TrainBatch", "build_batch", "token_logprobs"]

#: A prompt's token ids and its completion's.
Sample = tuple[Sequence[int], Sequence[int]]


@dataclass
class TrainBatch:
    """One micro-batch: the model's inputs and where its loss tokens are.

    Attributes:
        input_ids, position_ids: ``[rows, width]``; one row when packed.
        attention_mask: ``[rows, width]`` for padded rows; None when packed.
        samples: the indices (into the step's samples) of the samples in it.
        rows, columns: ``[loss tokens]``: the position predicting each loss token.
        targets: ``[loss tokens]``: the loss tokens' ids.
        token_sample: ``[loss tokens]``: which of ``samples`` (0-based) each belongs to.
        sample_tokens: ``[samples]``: loss tokens per sample.
        packed: whether the samples share one row.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    samples: list[int]
    rows: torch.Tensor
    columns: torch.Tensor
    targets: torch.Tensor
    token_sample: torch.Tensor
    sample_tokens: torch.Tensor
    packed: bool

    @property
    def num_tokens(self) -> int:
        """Tokens the forward computes (padding included)."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch on ``device``."""
        mask = self.attention_mask
        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            attention_mask=None if mask is None else mask.to(device),
            rows=self.rows.to(device),
            columns=self.columns.to(device),
            targets=self.targets.to(device),
            token_sample=self.token_sample.to(device),
            sample_tokens=self.sample_tokens.to(device),
        )

    def per_token(self, per_sample: torch.Tensor) -> torch.Tensor:
        """A value per sample of the step (``[step samples]``, e.g. advantages),
        repeated for each of this batch's loss tokens (``[loss tokens]``)."""
        index = torch.tensor(self.samples, dtype=torch.long, device=per_sample.device)
        return per_sample[index][self.token_sample.to(per_sample.device)]

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-loss-token ``values`` (flat, this batch's order) as one tensor per sample."""
        return list(torch.split(values.reshape(-1), self.sample_tokens.tolist()))

    def to_rows(self, values: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Per-loss-token ``values`` as ``[samples, width]``, each sample's left-aligned
        and zero after (``width``: the longest completion when None)."""
        counts = self.sample_tokens.tolist()
        width = max(counts, default=0) if width is None else width
        out = values.new_zeros((len(counts), width))
        for i, part in enumerate(self.split(values)):
            out[i, : part.numel()] = part[:width]
        return out


def build_batch(
    samples: Sequence[Sample], indices: Sequence[int], packed: bool, pad_id: int = 0
) -> TrainBatch:
    """The micro-batch of ``samples[i]`` for ``i`` in ``indices``, packed into one row
    or padded one row each. No indices give an empty micro-batch: one ``pad_id`` token
    and no loss tokens (it still runs the forward and backward every rank must run)."""
    chosen = [(list(samples[i][0]), list(samples[i][1])) for i in indices]
    rows: list[int] = []
    columns: list[int] = []
    targets: list[int] = []
    owner: list[int] = []
    counts: list[int] = []
    if packed or not chosen:
        ids: list[int] = []
        positions: list[int] = []
        for k, (prompt, completion) in enumerate(chosen):
            start = len(ids)
            sequence = prompt + completion
            ids += sequence
            positions += range(len(sequence))
            first = start + len(prompt) - 1  # the position predicting completion[0]
            loss = range(max(first, start), start + len(sequence) - 1)
            _record(loss, 0, ids, rows, columns, targets, owner, k)
            counts.append(len(loss))
        if not ids:
            ids, positions = [pad_id], [0]
        input_ids = torch.tensor([ids], dtype=torch.long)
        position_ids = torch.tensor([positions], dtype=torch.long)
        mask = None
    else:
        width = max(len(p) + len(c) for p, c in chosen)
        input_ids = torch.full((len(chosen), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chosen), width), dtype=torch.long)
        for k, (prompt, completion) in enumerate(chosen):
            sequence = prompt + completion
            input_ids[k, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
            mask[k, : len(sequence)] = 1
            loss = range(max(len(prompt) - 1, 0), len(sequence) - 1)
            _record(loss, k, input_ids[k].tolist(), rows, columns, targets, owner, k)
            counts.append(len(loss))
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        samples=list(indices),
        rows=torch.tensor(rows, dtype=torch.long),
        columns=torch.tensor(columns, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        token_sample=torch.tensor(owner, dtype=torch.long),
        sample_tokens=torch.tensor(counts, dtype=torch.long),
        packed=packed,
    )


def _record(
    loss: range,
    row: int,
    ids: list[int],
    rows: list[int],
    columns: list[int],
    targets: list[int],
    owner: list[int],
    sample: int,
) -> None:
    for column in loss:
        rows.append(row)
        columns.append(column)
        targets.append(ids[column + 1])
        owner.append(sample)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(unwrap_model(model).forward).parameters
    except (TypeError, ValueError):
        return False


def token_logprobs(
    model: nn.Module, batch: TrainBatch, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probability of each of ``batch``'s loss tokens at ``temperature``
    (``[loss tokens]``, float32), and with ``entropy`` the entropy of each predicted
    distribution (detached). ``model`` is a causal LM (prepared or not) returning
    ``.logits``; one that takes ``logits_to_keep`` computes the logits of the positions
    predicting loss tokens only."""
    # no KV cache: transformers keeps packed samples apart only without one
    kwargs: dict[str, Any] = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "use_cache": False,
    }
    if batch.attention_mask is not None:
        kwargs["attention_mask"] = batch.attention_mask
    group = ulysses.group_of(model)
    if group is not None and dist.get_world_size(group) > 1:
        return _sequence_parallel_logprobs(model, batch, kwargs, group, temperature, entropy)
    rows, columns = batch.rows, batch.columns
    if _takes_logits_to_keep(model):
        kept, where = torch.unique(columns, sorted=True, return_inverse=True)
        kwargs["logits_to_keep"] = kept
        logits = model(**kwargs).logits[rows, where]
    else:
        logits = model(**kwargs).logits[rows, columns]
    logp = (logits.float() / temperature).log_softmax(-1)
    picked = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1).detach() if entropy else None
    return picked, ent


def _sequence_parallel_logprobs(
    model: nn.Module,
    batch: TrainBatch,
    kwargs: dict[str, Any],
    group: Any,
    temperature: float,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Under Ulysses: each rank of the group runs the language-model head on its own
    slice of the sequence at the group's loss positions, and the per-token
    log-probabilities (not the hidden states) are gathered; each rank gets its own."""
    mine = (batch.rows.tolist(), batch.columns.tolist(), batch.targets.tolist())
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    request = loss_tokens.LossTokens(
        [(rows, columns) for rows, columns, _ in every], int(batch.input_ids.shape[0])
    )
    with loss_tokens.loss_tokens_only(request):
        logits = model(**kwargs).logits[0]  # [owned, vocab]
    assert request.owned is not None and request.mine is not None
    if request.total == sum(len(t) for _, _, t in every):
        targets = [t for _, _, chunk in every for t in chunk]
    else:  # the ranks hold the same rows: their loss tokens once
        targets = every[0][2]
    device = logits.device
    owned = request.owned.to(device)
    picked_targets = torch.tensor(targets, dtype=torch.long, device=device)[owned]
    logp = (logits.float() / temperature).log_softmax(-1)
    picked = logp.gather(-1, picked_targets.unsqueeze(-1)).squeeze(-1)
    full = picked.new_zeros(request.total).index_copy(0, owned, picked)
    gathered = ulysses.gather_sum_back(full.unsqueeze(0), group).sum(0)
    ent = None
    if entropy:
        spread = picked.new_zeros(request.total).index_copy(
            0, owned, -(logp.exp() * logp).sum(-1).detach()
        )
        dist.all_reduce(spread, group=group)
        ent = spread[request.mine.to(device)]
    return gathered[request.mine.to(device)], ent


#: The name of the packed-row attention in transformers' ``AttentionInterface``.
PACKED_ATTENTION = "lightrft_packed_sdpa"


def length_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """The samples of a packed row (their indices), longest first, grouped so that each
    group's longest is less than twice any of its others: padded to its group's width,
    a sample's attention then costs under 4x its own (``n`` samples in one group cost
    ``n`` times the longest one's square, which a row of one long sample and many short
    ones would pay for every short one)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and 2 * lengths[i] > lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA for a packed row: its samples, grouped by length (:func:`length_buckets`),
    are laid out as a padded batch inside the attention only and attend causally within
    themselves, one SDPA call per group, so a row's attention costs about what its
    samples cost apart, not the square of the row (the rest of the model stays packed);
    anything else (padded rows, a KV cache) goes to transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = kwargs.get("position_ids")
    if query.shape[0] != 1 or positions is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    flat = positions.reshape(-1)
    starts = (torch.diff(flat) != 1).nonzero().flatten() + 1
    if starts.numel() == 0:  # one sequence: plain causal
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    bounds = [0, *starts.tolist(), int(flat.numel())]
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    device = query.device
    pieces, places = [], []
    for bucket in length_buckets(lengths):
        begin = torch.tensor([bounds[i] for i in bucket], device=device)
        sizes = torch.tensor([lengths[i] for i in bucket], device=device)
        width = lengths[bucket[0]]
        offsets = torch.arange(width, device=device)
        valid = offsets.unsqueeze(0) < sizes.unsqueeze(1)  # [samples, width]
        index = (begin.unsqueeze(1) + offsets.unsqueeze(0)).clamp(max=int(flat.numel()) - 1)

        def batched(tensor: torch.Tensor, index: torch.Tensor = index) -> torch.Tensor:
            return tensor[0][:, index].transpose(0, 1)  # [1, h, T, d] -> [n, h, w, d]

        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # [n, 1, w, w]
        out = torch.nn.functional.scaled_dot_product_attention(
            batched(query), batched(key), batched(value), attn_mask=mask,
            scale=kwargs.get("scaling"), enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        pieces.append(out.transpose(1, 2)[valid])  # [tokens, heads, d]
        places.append(index[valid])
    # back to the row's order: [T, heads, d], then transformers' [1, T, heads, d]
    order = torch.cat(places).argsort()
    return torch.cat(pieces)[order].unsqueeze(0), None


def _packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask :data:`PACKED_ATTENTION` gets: none for one row without padding (the
    attention finds the row's samples from its positions, so transformers' packed mask
    would be built for nothing), else SDPA's."""
    from transformers.masking_utils import sdpa_mask

    if batch_size == 1 and attention_mask is None and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length,
        attention_mask=attention_mask, **kwargs,
    )  # fmt: skip


def use_packed_attention(model: nn.Module) -> nn.Module:
    """Make a Hugging Face model that attends with SDPA run packed rows with
    :func:`packed_sdpa_attention` (registered with transformers as
    :data:`PACKED_ATTENTION`). On CPU a packed row then costs what its samples cost
    apart; flash-attention's variable-length kernel does the same on CUDA. Returns
    ``model``; a model on another attention, or with sliding-window layers (whose
    windows this attention does not apply), is left as it is."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, _packed_attention_mask)
    for module in unwrap_model(model).modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation", None) != "sdpa":
            continue
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if set(layer_types) == {"full_attention"}:
            config._attn_implementation = PACKED_ATTENTION  # type: ignore[union-attr]
    return model
