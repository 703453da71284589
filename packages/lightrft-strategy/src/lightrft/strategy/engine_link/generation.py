"""Generation on the rollout engine, split over its tensor-parallel groups
(``engine_tp_size`` consecutive ranks): prompts gathered to the group, checked against
the engine's limits on every rank before any generates, outputs handed back per rank;
the same prompts of a sequence-parallel group generated once; upstream's multimodal
inputs in the canonical form."""

from __future__ import annotations

import hashlib
import pickle
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightrft.strategy import roll_call, sequence_parallel
from lightrft.strategy.engine_link.common import EngineSlot, limits, protocol_module
from lightrft.strategy.engine_link.sleep import Sleep

if TYPE_CHECKING:
    from lightrft.engines.protocol import GenerationOutput
    from lightrft.strategy.world import World


class Generation:
    """:meth:`generate` (upstream's ``gather_and_generate`` converts to it) and
    :meth:`generate_local` (upstream's ``engine_generate_local``)."""

    def __init__(self, world: World, slot: EngineSlot, sleep: Sleep) -> None:
        self.world = world
        self.slot = slot
        self.sleep = sleep

    def generate(
        self,
        prompts: Sequence[Any],
        sampling: Any,
        *,
        sleep_after: bool = False,
        refused: Exception | None = None,
    ) -> list[GenerationOutput]:
        """Generate for this rank's ``prompts`` (token-id lists or prompt dicts): the
        prompts of the engine's tensor-parallel group are gathered, checked (an empty
        prompt, a token id outside the vocabulary or a prompt too long for
        ``max_model_len`` raises on every rank before any generates, naming the rank and
        index), generated once, and each rank gets back exactly its own outputs (``n``
        per prompt, in order). Ranks may hold different numbers of prompts (zero too).
        Collective within the group.

        A sleeping engine is woken first; with ``sleep_after`` it is put back to sleep
        afterwards (when ``enable_engine_sleep`` is set), also when a prompt was refused.
        ``refused``: this rank's inputs could not be built; every rank of the group
        raises it (named with the rank), none generates."""
        if refused is None:
            self.sleep.wake(None, blind=False)
        try:
            with roll_call.guard("generate"):
                return self._once_per_sp_group(list(prompts), sampling, refused)
        finally:  # a refused prompt too: the trainer gets the memory back
            if sleep_after:
                self.sleep.maybe_sleep()

    def generate_local(
        self,
        sampling_params: Any,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        multi_modal_inputs: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[GenerationOutput]:
        """Generate on this rank's engine alone, without gathering (upstream's call):
        exactly one of ``prompt_token_ids`` and ``multi_modal_inputs``."""
        engine = self.slot.require("engine_generate_local")
        if (prompt_token_ids is None) == (multi_modal_inputs is None):
            raise ValueError(
                "engine_generate_local takes exactly one of prompt_token_ids and multi_modal_inputs"
            )
        prompts = list(prompt_token_ids if prompt_token_ids is not None else multi_modal_inputs)  # type: ignore[arg-type]
        self._check_prompts(engine, prompts, sampling_params, [len(prompts)], 0)
        return list(engine.generate(prompts, sampling_params))

    def _once_per_sp_group(
        self, prompts: list[Any], sampling: Any, refused: Exception | None
    ) -> list[GenerationOutput]:
        """The ranks of a sequence-parallel group usually hold the same prompts
        (upstream's ``SPDataProcessor.preprocess``, the demo's replicas): then the
        group's first rank generates them once and the others get its outputs, instead
        of the group generating the same rollouts ``sp_size`` times. Ranks of a group
        that hold different prompts each generate their own."""
        group = sequence_parallel.get_sequence_parallel_group()
        if group is None or dist.get_world_size(group) == 1 or refused is not None:
            return self._gather_generate(prompts, sampling, refused=refused)
        try:
            mine = hashlib.sha256(pickle.dumps((prompts, sampling))).hexdigest()
        except Exception:  # unpicklable inputs: treated as this rank's own
            mine = f"rank {self.world.get_rank()}"
        keys: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, mine, group=group)
        if len(set(keys)) > 1:
            return self._gather_generate(prompts, sampling)
        first = dist.get_global_rank(group, 0)
        leader = self.world.get_rank() == first
        # every rank still takes part in its engine group's gather (with no prompts)
        outputs = self._gather_generate(prompts if leader else [], sampling)
        holder: list[Any] = [outputs if leader else None]
        dist.broadcast_object_list(holder, src=first, group=group)
        return list(holder[0])

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
        engine = self.slot.require("generate")
        group_ranks = self.slot.group_ranks
        if getattr(engine, "collective", False):
            # engine ranks of their own serve every trainer rank in one call, which
            # checks the prompts: every rank takes part, with no prompts too
            outputs = list(engine.generate([] if refused else list(prompts), sampling))
            if refused is not None:
                raise refused
            return outputs
        if len(group_ranks) == 1:
            if refused is not None:
                raise refused
            if not prompts:
                return []
            self._check_prompts(
                engine, list(prompts), sampling, [len(prompts)], self.world.get_rank()
            )
            return list(engine.generate(list(prompts), sampling))
        mine = (list(prompts), None if refused is None else str(refused))
        gathered: list[Any] = [None] * len(group_ranks)
        dist.all_gather_object(gathered, mine, group=self.slot.group)
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
            if self.world.get_rank() == leader:
                holder[0] = list(engine.generate(everything, sampling)) if everything else []
            dist.broadcast_object_list(holder, src=leader, group=self.slot.group)
            outputs = holder[0]
        n = len(outputs) // len(everything) if everything else 1
        index = group_ranks.index(self.world.get_rank())
        start = sum(len(chunk) for chunk in per_rank[:index]) * n
        return outputs[start : start + len(per_rank[index]) * n]


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
