"""Generation on the rollout engine, split over its tensor-parallel groups
(``engine_tp_size`` consecutive ranks): prompts gathered to the group, checked against
the engine's limits on every rank before any generates, outputs handed back per rank;
upstream's multimodal inputs in the canonical form."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightrft.strategy.engine_link.common import limits, protocol_module
from lightrft.strategy.engine_link.sleep import SleepCalls

if TYPE_CHECKING:
    from lightrft.engines.protocol import GenerationOutput


class GenerationCalls(SleepCalls):
    """``gather_and_generate`` (ours and upstream's forms) and ``engine_generate_local``."""

    def gather_and_generate(
        self,
        prompts: Any = None,
        sampling: Any = None,
        *,
        sampling_params: Any = None,
        all_prompt_token_ids: Sequence[Sequence[int]] | None = None,
        all_prompts: Sequence[Any] | None = None,
        all_images: Sequence[Any] | None = None,
        sleep_engine: bool | None = None,
        images_num: Sequence[int] | None = None,
        all_videos: Sequence[Any] | None = None,
        videos_num: Sequence[int] | None = None,
        **more_media: Any,
    ) -> list[GenerationOutput]:
        """Generate for this rank's prompts: the prompts of the engine's tensor-parallel
        group are gathered, checked (an empty prompt, a token id outside the vocabulary
        or a prompt too long for ``max_model_len`` raises on every rank before any
        generates, naming the rank and index), generated once, and each rank gets back
        exactly its own outputs (``n`` per prompt, in order). Ranks may hold different
        numbers of prompts (zero too). Collective within the group.

        Our form: ``gather_and_generate(prompts, sampling)``. Upstream's form:
        ``gather_and_generate(sampling_params, all_prompt_token_ids=...)``, the sampling
        parameters positional or as ``sampling_params=`` (or
        ``all_prompts`` with ``all_images``/``images_num``/``all_videos``/``videos_num``
        for multimodal engines; each prompt gets all of its items, in order; another
        registered modality comes with its own keywords, e.g. ``all_audios`` and
        ``audios_num``, see :mod:`lightrft.engines.multimodal`).

        Both forms wake a sleeping engine first. After generating, upstream's form puts
        it back to sleep unless ``sleep_engine=False``; ours only with
        ``sleep_engine=True`` (either way only when ``enable_engine_sleep`` is set).
        ``sampling`` may be :class:`lightrft.engines.SamplingParams` or the engine's own:
        vLLM's ``SamplingParams`` pass through to vLLM unchanged; a dict (SGLang's, as
        upstream builds it) has its known keys mapped to ours and engine-specific ones
        handed to the engine (:func:`lightrft.engines.protocol.as_sampling_params`; a key
        no engine knows raises ``SamplingError`` naming it).

        Upstream's multimodal prompts are built by :meth:`_build_multimodal_inputs`
        (upstream's hook, called with its keywords; an override, such as upstream's
        audio example's, replaces it)."""
        if sampling_params is not None:
            given = all_prompt_token_ids is not None or all_prompts is not None
            ours = prompts is not None and not given and _looks_like_prompts(prompts)
            if sampling is not None or (prompts is not None and not ours):
                raise TypeError(
                    "gather_and_generate got sampling parameters twice (sampling_params= and "
                    "a positional argument); call gather_and_generate(sampling_params=..., "
                    "all_prompt_token_ids=[...]) or gather_and_generate(prompts, sampling)"
                )
            if prompts is not None:  # our form, sampling by upstream's keyword
                sampling = sampling_params
            else:  # upstream's form: sampling_params fills its first positional slot
                prompts = sampling_params
                if not given:
                    all_prompt_token_ids = []  # no prompts: nothing to generate
        upstream = (
            all_prompt_token_ids is not None
            or all_prompts is not None
            or (prompts is not None and not _looks_like_prompts(prompts))
        )
        if not upstream:
            self._wake(None, blind=False)
            try:
                return self._gather_generate(prompts or [], sampling)
            finally:  # a refused prompt too: the trainer gets the memory back
                if sleep_engine:
                    self.maybe_sleep_inference_engine()
        sampling_params = prompts
        if all_prompt_token_ids is None and all_prompts is None and sampling is not None:
            all_prompt_token_ids = sampling  # upstream's second positional argument
        if all_prompt_token_ids is None and all_prompts is None:
            raise TypeError(
                "gather_and_generate got no prompts: pass gather_and_generate(prompts, "
                "sampling) with a list of token-id lists, or upstream's "
                "gather_and_generate(sampling_params, all_prompt_token_ids=[...])"
            )
        more = _more_media(more_media)
        multimodal = any(x is not None for x in (all_images or ())) or any(
            x is not None for x in (all_videos or ())
        )
        multimodal = multimodal or any(items is not None for items, _ in more.values())
        refused: Exception | None = None  # raised on every rank of the group, below
        if multimodal:
            from lightrft.engines.multimodal import MediaError

            try:
                inputs: list[Any] = self._build_multimodal_inputs(
                    all_prompts=(
                        all_prompts if all_prompts is not None else list(all_prompt_token_ids or [])
                    ),
                    all_images=all_images, images_num=images_num,
                    all_videos=all_videos, videos_num=videos_num, **more,
                )  # fmt: skip
            except MediaError as exc:
                inputs, refused = [], exc
        elif all_prompt_token_ids is not None:
            inputs = list(all_prompt_token_ids)
        else:
            inputs = [{"prompt": text} for text in all_prompts or []]
        if refused is None:
            self.wakeup_inference_engine()
        try:
            return self._gather_generate(inputs, sampling_params, refused=refused)
        finally:
            if sleep_engine is not False:
                self.maybe_sleep_inference_engine()

    def _build_multimodal_inputs(
        self,
        all_prompts: Sequence[Any],
        all_images: Sequence[Any] | None = None,
        images_num: Sequence[int] | None = None,
        all_videos: Sequence[Any] | None = None,
        videos_num: Sequence[int] | None = None,
        **more: tuple[Sequence[Any] | None, Sequence[int] | None],
    ) -> list[dict[str, Any]]:
        """Upstream's hook: the engine inputs of upstream's multimodal form (see
        :func:`build_multimodal_inputs`). Override it (on the class or the instance, as
        upstream's audio example does) to build other inputs."""
        return build_multimodal_inputs(
            all_prompts, all_images, images_num, all_videos, videos_num, **more
        )

    def engine_generate_local(
        self,
        sampling_params: Any,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        multi_modal_inputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate on this rank's engine alone, without gathering (upstream's call):
        exactly one of ``prompt_token_ids`` and ``multi_modal_inputs``."""
        engine = self._require_engine("engine_generate_local")
        if (prompt_token_ids is None) == (multi_modal_inputs is None):
            raise ValueError(
                "engine_generate_local takes exactly one of prompt_token_ids and multi_modal_inputs"
            )
        prompts = list(prompt_token_ids if prompt_token_ids is not None else multi_modal_inputs)  # type: ignore[arg-type]
        self._check_prompts(engine, prompts, sampling_params, [len(prompts)], 0)
        return list(engine.generate(prompts, sampling_params))

    def _check_prompts(
        self, engine: Any, prompts: list[Any], sampling: Any, counts: list[int], first: int
    ) -> None:
        protocol = protocol_module()
        params = protocol.as_sampling_params(sampling)
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]

        def describe(index: int) -> str:
            slot = next(i for i in range(len(counts)) if index < bounds[i + 1])
            return f"prompt {index - bounds[slot]} of rank {first + slot}"

        token_prompts = [
            (i, p)
            for i, p in enumerate(prompts)
            if not (isinstance(p, Mapping) and "prompt_token_ids" not in p and "prompt" in p)
        ]
        vocab_size, max_model_len = limits(engine)
        for index, prompt in token_prompts:
            protocol.check_prompts(
                [prompt], params,
                vocab_size=vocab_size,
                max_model_len=max_model_len,
                describe=lambda _, index=index: describe(index),
            )  # fmt: skip

    def _gather_generate(
        self, prompts: Sequence[Any], sampling: Any, refused: Exception | None = None
    ) -> list[GenerationOutput]:
        """``refused``: this rank's inputs could not be built; every rank of the group
        raises it (named with the rank), none generates."""
        engine = self._require_engine("gather_and_generate")
        group_ranks = self._engine_group_ranks
        if len(group_ranks) == 1:
            if refused is not None:
                raise refused
            self._check_prompts(engine, list(prompts), sampling, [len(prompts)], self.get_rank())
            return list(engine.generate(list(prompts), sampling))
        mine = (list(prompts), None if refused is None else str(refused))
        gathered: list[Any] = [None] * len(group_ranks)
        dist.all_gather_object(gathered, mine, group=self._engine_group)
        errors = [
            (rank, error) for rank, (_, error) in zip(group_ranks, gathered, strict=True) if error
        ]
        if errors:
            from lightrft.engines.multimodal import MediaError

            rank, error = errors[0]
            raise MediaError(f"rank {rank}: {error}")
        per_rank = [chunk for chunk, _ in gathered]
        everything = [prompt for chunk in per_rank for prompt in chunk]
        # every rank checks the same prompts: all raise, none has started generating
        self._check_prompts(
            engine, everything, sampling, [len(c) for c in per_rank], group_ranks[0]
        )
        leader = group_ranks[0]
        if engine.generate_on_every_rank:
            outputs = list(engine.generate(everything, sampling)) if everything else []
        else:
            holder: list[Any] = [None]
            if self.get_rank() == leader:
                holder[0] = list(engine.generate(everything, sampling)) if everything else []
            dist.broadcast_object_list(holder, src=leader, group=self._engine_group)
            outputs = holder[0]
        n = len(outputs) // len(everything) if everything else 1
        index = group_ranks.index(self.get_rank())
        start = sum(len(chunk) for chunk in per_rank[:index]) * n
        return outputs[start : start + len(per_rank[index]) * n]


def _more_media(kwargs: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keywords of registered modalities other than image and video -> {name: (items,
    counts)}; an unknown keyword is a TypeError naming the ones accepted."""
    if not kwargs:
        return {}
    from lightrft.engines.multimodal import MODALITIES

    extra = {m.name: m for m in MODALITIES.values() if m.name not in ("image", "video")}
    accepted = {arg for m in extra.values() for arg in (m.items_arg, m.counts_arg)}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"gather_and_generate got unexpected keyword(s) {unknown}; other modalities' "
            f"keywords: {sorted(accepted) or 'none registered'} "
            "(lightrft.engines.multimodal.register_modality)"
        )
    return {
        name: (kwargs.get(m.items_arg), kwargs.get(m.counts_arg))
        for name, m in extra.items()
        if m.items_arg in kwargs or m.counts_arg in kwargs
    }


def _looks_like_prompts(obj: Any) -> bool:
    """A list of prompts (token-id lists or prompt dicts), not sampling parameters."""
    if isinstance(obj, (str, bytes, Mapping)) or not isinstance(obj, Sequence):
        return False
    return all(
        isinstance(p, Mapping) or (isinstance(p, Sequence) and not isinstance(p, str)) for p in obj
    )


def build_multimodal_inputs(
    prompts: Sequence[Any],
    images: Sequence[Any] | None,
    images_num: Sequence[int] | None,
    videos: Sequence[Any] | None,
    videos_num: Sequence[int] | None,
    **more: tuple[Sequence[Any] | None, Sequence[int] | None],
) -> list[dict[str, Any]]:
    """Upstream's multimodal prompts in the canonical form
    (:func:`lightrft.engines.multimodal.build_multimodal_inputs`): one ``{"prompt": text,
    "multi_modal_data": {"image": [...], "video": [...]}}`` per prompt, every item of a
    prompt in order (none: no ``multi_modal_data``). ``images``/``videos`` are one list
    per prompt or one flat list cut by ``images_num``/``videos_num``; ``more`` maps other
    registered modalities to (items, counts). Counts and items that disagree raise
    :class:`lightrft.engines.multimodal.MediaError` naming the prompt. As upstream, a
    text prompt left without images or videos loses its vision placeholders
    (``<|vision_start|><|image_pad|>...<|vision_end|>``)."""
    from lightrft.engines.multimodal import build_multimodal_inputs as canonical

    media = {"image": (images, images_num), "video": (videos, videos_num), **more}
    out = canonical(prompts, {k: v for k, v in media.items() if v[0] is not None or v[1]})
    for entry in out:
        text = entry.get("prompt")
        if isinstance(text, str) and "multi_modal_data" not in entry:
            entry["prompt"] = _VISION_PLACEHOLDERS.sub("", text)
    return out


_VISION_PLACEHOLDERS = re.compile(
    r"<\|vision_start\|>((<\|image_pad\|>)+|(<\|video_pad\|>)+)<\|vision_end\|>"
)
