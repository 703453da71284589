"""Multimodal prompts: one canonical per-prompt form, from upstream's two input shapes.

The canonical form is the protocol's dict prompt: ``{"prompt": text}`` or
``{"prompt_token_ids": [...]}``, plus ``"multi_modal_data": {"image": [...], "video":
[...]}`` listing every item of the prompt, in order (no key for a modality the prompt
has none of). Engines read it with :func:`prompt_media`.

Upstream LightRFT callers pass a modality in one of two shapes (``gather_and_generate``'s
``all_images``/``images_num``, ``all_videos``/``videos_num``):

- nested: one list per prompt, ``[[a1, a2], [b1], []]`` (the counts, when given, must
  match each list);
- flat: one list for all prompts, cut by the counts: ``[a1, a2, b1]`` with ``[2, 1, 0]``.

:func:`media_per_prompt` turns either into one list per prompt, and raises
:class:`MediaError` naming the prompt index when the counts and the items disagree
(upstream's own code dropped the images of a nested list given without counts, and
sent SGLang only the first image of a prompt: neither can happen here).

Modalities are registered (:func:`register_modality`): ``image`` and ``video`` are built
in; another (audio, say) is one :class:`Modality` with the names each engine uses,
after which ``gather_and_generate`` accepts its upstream-style keywords and every
engine passes its items on. No engine code changes::

    register_modality(Modality("audio", items_arg="all_audios", counts_arg="audios_num",
                               sglang_arg="audio_data"))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightrft.engines.protocol import SamplingError


class MediaError(SamplingError):
    """Multimodal items that do not fit their prompts; the message names the prompt index,
    the modality, the count given and the items found."""


@dataclass(frozen=True)
class Modality:
    """A kind of media a prompt can carry.

    Attributes:
        name: its key in ``multi_modal_data`` (vLLM's name for it too).
        items_arg, counts_arg: the ``gather_and_generate`` keywords for its items and
            per-prompt counts (upstream's ``all_images`` / ``images_num``).
        sglang_arg: the ``sglang.Engine.generate`` keyword taking its items per request
            (None: SGLang cannot take it).
    """

    name: str
    items_arg: str
    counts_arg: str
    sglang_arg: str | None = None


MODALITIES: dict[str, Modality] = {
    "image": Modality("image", "all_images", "images_num", "image_data"),
    "video": Modality("video", "all_videos", "videos_num", "video_data"),
}


def register_modality(modality: Modality) -> None:
    """Add (or replace) a modality; its keywords must not clash with another's."""
    for other in MODALITIES.values():
        if other.name == modality.name:
            continue
        clash = {modality.items_arg, modality.counts_arg} & {other.items_arg, other.counts_arg}
        if clash:
            raise ValueError(
                f"modality {modality.name!r}: keyword(s) {sorted(clash)} already belong to "
                f"{other.name!r}"
            )
    MODALITIES[modality.name] = modality


def unregister_modality(name: str) -> None:
    if name in ("image", "video"):
        raise ValueError(f"{name!r} is built in and cannot be removed")
    MODALITIES.pop(name, None)


def media_per_prompt(
    n_prompts: int,
    items: Sequence[Any] | None,
    counts: Sequence[int] | None,
    *,
    kind: str = "image",
) -> list[list[Any]]:
    """One list of items per prompt, from the nested or the flat shape (module doc).

    Args:
        n_prompts: how many prompts there are.
        items: nested (one list, or None, per prompt) or flat; None: no items at all.
        counts: items per prompt (required for the flat shape).
        kind: the modality's name, for messages.

    Raises:
        MediaError: the shapes disagree; the message names the first prompt that does
            not fit.
    """
    if counts is not None:
        counts = list(counts)
        if len(counts) != n_prompts:
            raise MediaError(
                f"{len(counts)} {kind} counts for {n_prompts} prompts: give one count per prompt"
            )
        bad = next((i for i, c in enumerate(counts) if not _count(c)), None)
        if bad is not None:
            raise MediaError(f"prompt {bad}: {kind} count {counts[bad]!r} is not an int >= 0")
    if items is None:
        if counts is not None and any(counts):
            first = next(i for i, c in enumerate(counts) if c)
            raise MediaError(
                f"prompt {first}: {kind} count {counts[first]} but no {kind}s were given"
            )
        return [[] for _ in range(n_prompts)]
    items = list(items)
    nested = len(items) == n_prompts and all(
        x is None or isinstance(x, list | tuple) for x in items
    )
    per_prompt = [[] if x is None else list(x) for x in items] if nested else []
    if counts is None:
        if nested:
            return per_prompt
        raise MediaError(
            f"{len(items)} {kind}(s) for {n_prompts} prompts without per-prompt counts: "
            f"give one list per prompt, or a flat list with the counts"
        )
    if nested and all(len(got) == want for got, want in zip(per_prompt, counts, strict=True)):
        return per_prompt
    if sum(counts) != len(items):
        if nested:
            i = next(
                i for i, (g, w) in enumerate(zip(per_prompt, counts, strict=True)) if len(g) != w
            )
            raise MediaError(
                f"prompt {i}: {kind} count {counts[i]} but its list has {len(per_prompt[i])} "
                f"{kind}(s)"
            )
        at = 0
        for i, count in enumerate(counts):
            if at + count > len(items):
                raise MediaError(
                    f"prompt {i}: {kind} count {count} but only {len(items) - at} {kind}(s) "
                    f"are left of the {len(items)} given (counts {counts})"
                )
            at += count
        raise MediaError(
            f"the {kind} counts add up to {sum(counts)} but {len(items)} {kind}(s) were "
            f"given: {len(items) - sum(counts)} would belong to no prompt (counts {counts})"
        )
    out, at = [], 0
    for count in counts:
        out.append(items[at : at + count])
        at += count
    return out


def build_multimodal_inputs(
    prompts: Sequence[Any], media: Mapping[str, tuple[Sequence[Any] | None, Sequence[int] | None]]
) -> list[dict[str, Any]]:
    """Canonical prompts: each of ``prompts`` (text, token ids, or already a dict) with the
    items ``media`` (modality name -> (items, counts)) gives it.

    Raises:
        MediaError: an unregistered modality, or items that do not fit (see
            :func:`media_per_prompt`).
    """
    unknown = sorted(set(media) - set(MODALITIES))
    if unknown:
        raise MediaError(
            f"unknown modalities {unknown}; registered: {sorted(MODALITIES)} "
            "(lightrft.engines.multimodal.register_modality adds one)"
        )
    lists = {
        name: media_per_prompt(len(prompts), items, counts, kind=name)
        for name, (items, counts) in media.items()
    }
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Mapping):
            entry = dict(prompt)
        elif isinstance(prompt, str):
            entry = {"prompt": prompt}
        else:
            entry = {"prompt_token_ids": list(prompt)}
        data = dict(entry.get("multi_modal_data") or {})
        for name, per_prompt in lists.items():
            if per_prompt[i]:
                data[name] = list(per_prompt[i])
        entry.pop("multi_modal_data", None)
        if data:
            entry["multi_modal_data"] = data
        out.append(entry)
    return out


def prompt_media(prompt: Any) -> dict[str, list[Any]]:
    """A prompt's items per modality (empty for a plain token list). An unregistered
    modality raises :class:`MediaError`."""
    if not isinstance(prompt, Mapping):
        return {}
    data = prompt.get("multi_modal_data") or {}
    unknown = sorted(set(data) - set(MODALITIES))
    if unknown:
        raise MediaError(
            f"a prompt carries unknown modalities {unknown}; registered: {sorted(MODALITIES)}"
        )
    return {name: _as_list(value) for name, value in data.items() if value is not None}


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
