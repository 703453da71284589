"""Rollouts in flight at a checkpoint, as the checkpoint holds them (plain values: what
``torch.load(weights_only=True)`` gives back), so that a resumed one-step-off run uses
the very rollouts the interrupted run would have used instead of generating them again
from newer weights.

A request is known by :func:`request_key`: a digest of its prompts (token ids, and the
bytes of any multimodal data) and of its sampling parameters; the resumed loop submits
its prompts again, and the held outputs are returned when the keys agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch

from lightrft.strategy.engine_link.common import protocol_module

#: The fields of a held output (``lightrft.engines.protocol.GenerationOutput``).
OUTPUT_FIELDS = ("prompt_token_ids", "output_token_ids", "finish_reason", "logprobs",
                 "weight_version")  # fmt: skip


def request_key(prompts: Sequence[Any], sampling: Any) -> str:
    """A digest of ``prompts`` and ``sampling`` (as neutral SamplingParams): equal for
    the same request submitted by the interrupted and by the resumed run."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(_prompt_bytes(prompt))
        digest.update(b"\x00")
    digest.update(repr(protocol_module().as_sampling_params(sampling)).encode())
    return digest.hexdigest()


def _prompt_bytes(prompt: Any) -> bytes:
    if isinstance(prompt, dict):
        parts = [json.dumps(list(prompt.get("prompt_token_ids", ())))]
        for key in sorted(k for k in prompt if k != "prompt_token_ids"):
            parts.append(f"{key}={_value_bytes(prompt[key]).hex()}")
        return "|".join(parts).encode()
    return json.dumps([int(t) for t in prompt]).encode()


def _value_bytes(value: Any) -> bytes:
    """Bytes that tell values apart: the data of tensors, arrays and images (their
    ``tobytes``), recursively through containers; ``repr`` for the rest."""
    if isinstance(value, dict):
        return b"{" + b",".join(k.encode() + b":" + _value_bytes(v) for k, v in
                                sorted(value.items())) + b"}"  # fmt: skip
    if isinstance(value, list | tuple):
        return b"[" + b",".join(_value_bytes(v) for v in value) + b"]"
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy()
    tobytes = getattr(value, "tobytes", None)  # numpy arrays, PIL images
    if callable(tobytes):
        return hashlib.sha256(tobytes()).digest()
    return repr(value).encode()


def plain_outputs(outputs: Sequence[Any]) -> list[dict[str, Any]] | None:
    """``outputs`` as plain dicts, or None when one is not a GenerationOutput-like
    dataclass (such rollouts are generated again after a resume)."""
    held = []
    for output in outputs:
        if not dataclasses.is_dataclass(output) or isinstance(output, type):
            return None
        fields = dataclasses.asdict(output)
        if set(OUTPUT_FIELDS) - fields.keys():
            return None
        held.append({name: fields[name] for name in OUTPUT_FIELDS})
    return held


def outputs_from_plain(held: Sequence[dict[str, Any]]) -> list[Any]:
    """The GenerationOutputs :func:`plain_outputs` gave."""
    output_class = protocol_module().GenerationOutput
    return [output_class(**{name: item[name] for name in OUTPUT_FIELDS}) for item in held]
