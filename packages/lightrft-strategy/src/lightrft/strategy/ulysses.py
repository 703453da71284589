# size: one mechanism read together: the hooks on the decoder, the attention they route
#   to, the exchanges both use and the checks of what can be split
"""Ulysses sequence parallelism for Hugging Face decoders, with no change to model code.

With ``sp_size = k > 1`` the strategy calls :func:`apply_ulysses` on every model it
prepares. Two forward hooks go on the model's decoder (``Qwen2Model``, ``LlamaModel``,
the language model of Qwen2-VL, ...) and its attention implementation becomes
:data:`ATTENTION_NAME`, registered in transformers' ``AttentionInterface``:

* before the decoder runs, the ``k`` ranks of a sequence-parallel group pool their
  rows (padded to one length, a multiple of ``k``), and each rank keeps ``1/k`` of the
  sequence of every row, with the global position ids (for RoPE). If every rank of the
  group holds the same rows (upstream's ``SPDataProcessor.preprocess`` made them so)
  they are computed once instead of ``k`` times;
* in each attention layer, queries, keys and values go through an all-to-all, so each
  rank attends over the whole sequence for ``heads / k`` heads, with the model's own
  attention function (``sdpa`` or ``eager``) and a mask built from the whole rows:
  causal, padding and packed sequences (positions restarting at 0 when no attention mask
  is given, transformers' rule); a second all-to-all restores ``seq / k`` tokens with
  all heads;
* after the decoder, the hidden states are gathered along the sequence and each rank
  gets back exactly its own rows, unpadded: the language-model head, the loss and the
  log-probabilities see the shapes they would see at ``sp_size = 1``. Inside
  :func:`lightrft.strategy.loss_tokens.loss_tokens_only` nothing is gathered: each
  rank keeps its slice at the group's loss positions (see that module).

The data design is upstream's: every rank loads its own share of the data (the sampler
shards by global rank, as at ``sp_size = 1``) and the group computes its rows together.
The backward of the final gather sums the gradient of every rank's loss into the slice
that produced it, so the gradients the backends then average over all ranks equal those
of the same global batch at ``sp_size = 1``: no ``k`` correction is needed, whether the
rows were pooled or replicated by ``preprocess``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightrft.strategy import loss_tokens, sequence_parallel
from lightrft.strategy.actor import training_module

#: The name of the Ulysses attention in transformers' ``AttentionInterface``.
ATTENTION_NAME = "lightrft_ulysses"
#: ``model_type`` of the decoder configs the hook is tested on.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen2_vl_text", "qwen2_5_vl_text")
#: The model attention implementations Ulysses can run inside.
INNER_ATTENTIONS = ("sdpa", "eager")
#: The keyword that carries a forward's :class:`_Context` down to the attention layers
#: (transformers passes a decoder's extra keywords to every attention call, also when a
#: layer is recomputed by activation checkpointing).
_CONTEXT_KEY = "lightrft_ulysses_context"


class SequenceParallelError(ValueError):
    """A model or input that Ulysses sequence parallelism cannot split."""


@dataclass
class _Context:
    group: Any
    size: int
    rank: int
    inner: str
    mask: torch.Tensor | None  # [rows, 1, seq, seq] bool (True: attend); None: causal
    rows: slice | None  # this rank's rows of the pooled batch; None: rows replicated
    length: int  # this rank's own sequence length
    padded: int  # the group's sequence length, a multiple of size


@dataclass
class _Applied:
    group: Any
    inner: str
    handles: tuple[Any, ...]


_APPLIED: weakref.WeakKeyDictionary[nn.Module, _Applied] = weakref.WeakKeyDictionary()


# -- exchanges ---------------------------------------------------------------------------


def _gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _GatherSumBack(torch.autograd.Function):
    """Forward: every rank's tensor concatenated along ``dim``. Backward: the sum, over
    the group, of the gradients for this rank's part (a reduce-scatter, made of an
    all-to-all since gloo has no reduce-scatter): each rank's own loss reaches the slice
    that produced what it used."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(tensor, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        inputs = [part.contiguous() for part in grad.chunk(size, dim=ctx.dim)]
        outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
        dist.all_to_all(outputs, inputs, group=ctx.group)
        return torch.stack(outputs).sum(0), None, None


def gather_sum_back(tensor: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim``; the backward sums, over the
    group, the gradients for this rank's part."""
    out: torch.Tensor = _GatherSumBack.apply(tensor, group, dim)
    return out


def _pad_to(tensor: torch.Tensor, length: int, dim: int, value: float = 0) -> torch.Tensor:
    missing = length - tensor.size(dim)
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


# -- the attention -------------------------------------------------------------------------


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` is ``[batch, heads, seq / k, dim]``
    (keys and values with their own head count); returns ``[batch, seq / k, heads,
    dim]`` as transformers' own attention functions do."""
    del attention_mask  # built for seq / k tokens; the context holds the whole rows' mask
    context: _Context | None = kwargs.pop(_CONTEXT_KEY, None)
    if context is None:
        raise SequenceParallelError(
            f"{type(module).__name__}: attention '{ATTENTION_NAME}' ran outside a forward "
            "of the decoder it was applied to; call the model, not its layers"
        )
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = context.group
    # sequence shards with all heads -> the whole sequence with heads / k
    q, k, v = sequence_parallel._SeqAllToAll.apply(group, [1, 1, 1], [2, 2, 2], query, key, value)
    inner = _eager if context.inner == "eager" else ALL_ATTENTION_FUNCTIONS[context.inner]
    mask = context.mask
    if mask is not None and context.inner == "eager":
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, torch.finfo(q.dtype).min
        )
    out, _ = inner(module, q, k, v, mask, **kwargs)  # [batch, seq, heads / k, dim]
    # the whole sequence with heads / k -> sequence shards with all heads
    merged: torch.Tensor = sequence_parallel._SeqAllToAll.apply(group, 1, 2, out)
    return merged, None


def _eager(module: nn.Module, q: Any, k: Any, v: Any, mask: Any, **kwargs: Any) -> Any:
    # transformers' eager attention lives in each model's module; llama's is the reference
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, q, k, v, mask, **kwargs)


def _register() -> None:
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            "sequence parallelism (sp_size > 1) needs transformers: "
            "pip install 'lightrft-strategy[hf]'"
        ) from exc

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)


# -- finding and checking the decoder ------------------------------------------------------


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder (the module holding the attention layers) of a Hugging Face causal
    LM, a vision-language model, or upstream's actor wrapping one."""
    module = training_module(model)
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        get = getattr(module, "get_decoder", None)
        try:
            inner = get() if callable(get) else None
        except Exception:
            inner = None
        if not isinstance(inner, nn.Module) or inner is module:
            break
        module = inner
    return module


def check_model(model: nn.Module, sp_size: int) -> nn.Module:
    """Raise :class:`SequenceParallelError` if ``model`` cannot run Ulysses attention
    over ``sp_size`` ranks; return its decoder."""
    decoder = decoder_of(model)
    config = getattr(decoder, "config", None)
    name = type(training_module(model)).__name__
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SequenceParallelError(
            f"sp_size={sp_size}: {name} (decoder {type(decoder).__name__}, model_type "
            f"{model_type!r}) is not a model family Ulysses sequence parallelism supports; "
            f"supported decoder model_type values: {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Use one of those or set sp_size=1"
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None) or config.num_attention_heads  # type: ignore[union-attr]
        if heads % sp_size:
            accepted = [d for d in range(1, heads + 1) if heads % d == 0]
            raise SequenceParallelError(
                f"sp_size={sp_size}: {name} has {field}={heads}, which sp_size must divide "
                f"(each rank attends with {field} / sp_size heads); accepted sp_size values "
                f"for this model: {', '.join(map(str, accepted))}"
            )
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise SequenceParallelError(
            f"sp_size={sp_size}: {name} uses sliding-window attention, which the Ulysses "
            "mask does not build; set use_sliding_window=False or sp_size=1"
        )
    inner = _inner_of(decoder)
    if inner not in INNER_ATTENTIONS:
        raise SequenceParallelError(
            f"sp_size={sp_size}: {name} runs attention implementation {inner!r}; Ulysses "
            f"runs inside one of {', '.join(INNER_ATTENTIONS)}: load the model with "
            "attn_implementation='sdpa' or set sp_size=1"
        )
    return decoder


def _inner_of(decoder: nn.Module) -> str:
    applied = _APPLIED.get(decoder)
    if applied is not None:
        return applied.inner
    return getattr(decoder.config, "_attn_implementation", None) or "eager"


# -- applying --------------------------------------------------------------------------------


def apply_ulysses(model: nn.Module, group: Any) -> nn.Module:
    """Make ``model``'s decoder run Ulysses attention over ``group`` (checked first with
    :func:`check_model`). Idempotent; returns ``model``."""
    size = dist.get_world_size(group)
    decoder = check_model(model, size)
    if decoder in _APPLIED:
        return model
    _register()
    inner = _inner_of(decoder)
    setattr(decoder.config, "_attn_implementation", ATTENTION_NAME)  # noqa: B010
    handles = (
        decoder.register_forward_pre_hook(_before_decoder, with_kwargs=True),
        decoder.register_forward_hook(_after_decoder, with_kwargs=True),
    )
    _APPLIED[decoder] = _Applied(group, inner, handles)
    return model


def remove_ulysses(model: nn.Module) -> None:
    """Undo :func:`apply_ulysses` (the model attends as before)."""
    decoder = decoder_of(model)
    applied = _APPLIED.pop(decoder, None)
    if applied is not None:
        for handle in applied.handles:
            handle.remove()
        setattr(decoder.config, "_attn_implementation", applied.inner)  # noqa: B010


def group_of(model: nn.Module) -> Any:
    """The group ``model``'s decoder runs Ulysses attention over, or None."""
    applied = _APPLIED.get(decoder_of(model))
    return None if applied is None else applied.group


def is_applied(model: nn.Module) -> bool:
    """Whether ``model``'s decoder runs Ulysses attention."""
    return decoder_of(model) in _APPLIED


def describe(model: nn.Module) -> str:
    """One line on how ``model``'s sequences are split, for logs."""
    decoder = decoder_of(model)
    applied = _APPLIED.get(decoder)
    if applied is None:
        return "sequences not split (sp_size 1)"
    size = dist.get_world_size(applied.group)
    return (
        f"Ulysses sequence parallelism: {type(decoder).__name__}'s sequences split over "
        f"{size} ranks, attention '{applied.inner}' on 1/{size} of the heads each"
    )


# -- the hooks ---------------------------------------------------------------------------------


def _row_keys(
    mask: torch.Tensor | None,
    positions: torch.Tensor | None,
    rows: int,
    length: int,
    device: Any,
    packed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's per-token facts: which tokens are real keys, and which packed
    sequence each belongs to (when ``packed``; positions that do not step by 1)."""
    valid = (
        torch.ones(rows, length, dtype=torch.bool, device=device)
        if mask is None
        else mask.to(device=device, dtype=torch.bool)
    )
    segments = torch.zeros(rows, length, dtype=torch.long, device=device)
    if packed and positions is not None and positions.dim() == 2:
        # as transformers' find_packed_sequence_indices
        text = positions.expand(rows, length)
        diff = torch.diff(text, prepend=text[:, :1] - 1, dim=-1)
        segments = (diff != 1).cumsum(-1)
    return valid, segments


def _build_mask(valid: torch.Tensor, segments: torch.Tensor) -> torch.Tensor | None:
    """``[rows, 1, seq, seq]``: causal, to real keys of the same packed sequence (the
    mask transformers builds for the whole rows; a left pad's query row stays empty, as
    there). None when plain causal."""
    if bool(valid.all()) and not bool(segments.any()):
        return None
    length = valid.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    return (causal & same & valid.unsqueeze(1)).unsqueeze(1)


def _before_decoder(
    decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    applied = _APPLIED[decoder]
    group = applied.group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    kwargs = dict(kwargs)
    if args:  # decoder(input_ids, ...) called positionally
        kwargs.setdefault("input_ids", args[0])
        args = ()
    if kwargs.get("past_key_values") is not None and _cache_len(kwargs["past_key_values"]):
        raise SequenceParallelError(
            f"{type(decoder).__name__}: generation with a KV cache does not run under "
            "sequence parallelism; generate with the inference engine (or a model "
            "prepared at sp_size=1)"
        )
    # transformers' rule (masking_utils): samples packed in a row are kept apart only when
    # no attention mask is given and no cache is used (use_cache=False, as in training)
    caching = kwargs.get("use_cache")
    if caching is None:
        caching = getattr(decoder.config, "use_cache", False)
    packed = kwargs.get("attention_mask") is None and not caching
    kwargs["use_cache"], kwargs["past_key_values"], kwargs["cache_position"] = False, None, None
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    tokens = embeds if embeds is not None else ids
    if tokens is None:
        raise SequenceParallelError(f"{type(decoder).__name__}: no input_ids or inputs_embeds")
    rows, length = tokens.shape[:2]
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is not None and mask.dim() != 2:
        raise SequenceParallelError(
            f"{type(decoder).__name__}: a {mask.dim()}D attention_mask cannot be split over "
            "the sequence; pass the 2D [batch, seq] padding mask"
        )
    valid, segments = _row_keys(mask, positions, rows, length, tokens.device, packed)
    if positions is None:
        positions = torch.arange(length, device=tokens.device).expand(rows, length)
    elif positions.dim() == 2:
        positions = positions.expand(rows, length)

    # one length for the group, a multiple of its size
    lengths = [torch.zeros((), dtype=torch.long) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor(length), group=group)
    longest = max(int(n) for n in lengths)
    padded = longest + (-longest % size)
    tokens = _pad_to(tokens, padded, 1)
    valid = _pad_to(valid, padded, 1, False)
    segments = _pad_to(segments, padded, 1)
    positions = _pad_positions(positions, padded)

    # pool the group's rows, unless every rank holds the same rows
    same = all(int(n) == length for n in lengths) and _replicated(
        (tokens, valid, segments, positions), group
    )
    if same:
        row_slice = None
    else:
        counts = [torch.zeros((), dtype=torch.long) for _ in range(size)]
        dist.all_gather(counts, torch.tensor(rows), group=group)
        if any(int(n) != rows for n in counts):
            raise SequenceParallelError(
                f"{type(decoder).__name__}: the ranks of a sequence-parallel group passed "
                f"{[int(n) for n in counts]} rows; they must pass the same number (give "
                "every rank the same micro-batch size)"
            )
        tokens = (
            _GatherSumBack.apply(tokens, group, 0)
            if tokens.is_floating_point()
            else _gather(tokens, group, 0)
        )
        valid = _gather(valid, group, 0)
        segments = _gather(segments, group, 0)
        positions = _gather(positions, group, positions.dim() - 2)
        row_slice = slice(rank * rows, (rank + 1) * rows)

    part = slice(rank * (padded // size), (rank + 1) * (padded // size))
    key = "inputs_embeds" if embeds is not None else "input_ids"
    kwargs[key] = tokens[:, part]
    kwargs["position_ids"] = positions[..., part]
    kwargs["attention_mask"] = None  # the context's mask covers the whole rows
    kwargs[_CONTEXT_KEY] = _Context(
        group=group,
        size=size,
        rank=rank,
        inner=applied.inner,
        mask=_build_mask(valid, segments),
        rows=row_slice,
        length=length,
        padded=padded,
    )
    return args, kwargs


def _after_decoder(
    decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    del decoder, args
    context: _Context = kwargs[_CONTEXT_KEY]
    request = loss_tokens.requested()
    if request is not None:  # no gather: this rank's share of the loss positions

        def owned(hidden: torch.Tensor) -> torch.Tensor:
            replicated = context.rows is None
            return loss_tokens.owned_positions(
                hidden, context.rank, context.size, context.padded, replicated, request
            )

        if isinstance(output, tuple):
            return (owned(output[0]), *output[1:])
        output.last_hidden_state = owned(output.last_hidden_state)
        return output

    def whole(hidden: torch.Tensor) -> torch.Tensor:
        full: torch.Tensor = _GatherSumBack.apply(hidden, context.group, 1)
        if context.rows is not None:
            full = full[context.rows]
        return full[:, : context.length]

    if isinstance(output, tuple):
        return (whole(output[0]), *output[1:])
    output.last_hidden_state = whole(output.last_hidden_state)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(whole(h) for h in output.hidden_states)
    return output


def _pad_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - positions.size(-1)
    if not missing:
        return positions
    last = positions[..., -1:]
    steps = torch.arange(1, missing + 1, device=positions.device, dtype=positions.dtype)
    return torch.cat([positions, last + steps], dim=-1)


def _replicated(tensors: tuple[torch.Tensor, ...], group: Any) -> bool:
    """Whether every rank of ``group`` holds equal ``tensors`` (same shapes assumed)."""
    mine = torch.tensor(
        [float(t.detach().double().sum()) for t in tensors]
        + [float((t.detach().double() * _weights(t)).sum()) for t in tensors],
        dtype=torch.float64,
    )
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        return False
    # checksums agree: confirm exactly (rare unless the rows really are replicated)
    for tensor in tensors:
        gathered = _gather(tensor.detach().unsqueeze(0), group, 0)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            return False
    return True


def _weights(tensor: torch.Tensor) -> torch.Tensor:
    flat = torch.arange(1, tensor.numel() + 1, dtype=torch.float64, device=tensor.device)
    return flat.reshape(tensor.shape)


def _cache_len(cache: Any) -> int:
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if callable(get) else 1
