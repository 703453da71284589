"""The compatibility room: upstream LightRFT's names on the strategy, and its call shapes.

:class:`~lightrft.strategy.StrategyBase` mixes these in; each is a thin delegate:

* :class:`UpstreamAttributes`: upstream's read-only attributes (``strategy.bf16``,
  ``strategy.zpg``, ...), each the configuration's field of the same name;
* :class:`UpstreamEngineCalls`: upstream's engine calls whose call shapes differ from
  ours (``setup_inference_engine``, ``gather_and_generate``) and its aliases
  (``inference_engine``, ``engine_mp_group``), each converted here, once, into one call
  of the strategy's engine link (:class:`lightrft.strategy.engine_link.EngineLink`).
  The engine calls whose upstream call shape ours accepts as it is
  (``update_engine_weights(actor)``, ``maybe_sleep_inference_engine()``,
  ``wakeup_inference_engine()``, ``engine_generate_local(...)``) and our
  ``verify_engine_weights`` are plain methods of ``StrategyBase``.

Where one name takes two shapes (``gather_and_generate(prompts, sampling)`` and
upstream's ``gather_and_generate(sampling_params, all_prompt_token_ids=...)``;
``setup_inference_engine(engine)`` and upstream's ``setup_inference_engine(args,
engine_type=...)``), the shape is recognised in this module and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from lightrft.strategy.engine_link import build_multimodal_inputs

if TYPE_CHECKING:
    from lightrft.config import StrategyConfig
    from lightrft.engines.protocol import GenerationOutput
    from lightrft.strategy.engine_link import EngineLink

__all__ = ["UpstreamAttributes", "UpstreamEngineCalls"]


class UpstreamAttributes:
    """Mixed into :class:`~lightrft.strategy.StrategyBase`."""

    if TYPE_CHECKING:
        config: StrategyConfig

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def max_norm(self) -> float:
        return self.config.max_norm

    @property
    def micro_train_batch_size(self) -> int:
        return self.config.micro_train_batch_size

    @property
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def bf16(self) -> bool:
        return self.config.bf16

    @property
    def adam_offload(self) -> bool:
        return self.config.adam_offload

    @property
    def zpg(self) -> int:
        return self.config.zpg

    @property
    def grad_accum_dtype(self) -> str | None:
        return self.config.grad_accum_dtype

    @property
    def overlap_comm(self) -> bool:
        return self.config.overlap_comm

    @property
    def engine_type(self) -> str:
        return self.config.engine_type


class UpstreamEngineCalls:
    """Upstream's engine calls on the strategy, delegating to ``strategy.engine_link``."""

    if TYPE_CHECKING:
        engine_link: EngineLink

    @property
    def inference_engine(self) -> Any:
        """The rollout engine (None until :meth:`setup_inference_engine`)."""
        return self.engine_link.inference_engine

    @inference_engine.setter
    def inference_engine(self, engine: Any) -> None:
        self.engine_link.inference_engine = engine

    @property
    def engine_mp_group(self) -> Any:
        """The process group of this rank's engine tensor-parallel group (None for a
        group of one)."""
        return self.engine_link.engine_group

    def setup_inference_engine(
        self,
        engine: Any = None,
        engine_type: str | None = None,
        actor: nn.Module | None = None,
        **engine_options: Any,
    ) -> Any:
        """Set up the rollout engine. Collective. Returns the engine.

        Upstream's form, ``setup_inference_engine(args, engine_type="vllm", actor=actor)``:
        build the engine ``args`` (an argparse namespace or config; None: this strategy's
        config) selects with :func:`lightrft.engines.build_engine` (``engine_type`` and
        ``engine_options`` override it; upstream's default ``engine_type="vllm"``
        ignored ``args.engine_type``, here None reads it), send ``actor``'s weights
        when given, and put the engine to sleep when ``enable_engine_sleep`` is set, in
        upstream's order (:meth:`EngineLink.build`). Our form,
        ``setup_inference_engine(engine)``: use a ready object implementing
        :class:`lightrft.engines.protocol.InferenceEngine` (one per rank), as handed
        over (synced with ``actor`` if given, not put to sleep; :meth:`EngineLink.attach`).
        Either way the tensor-parallel groups of ``engine_tp_size`` consecutive ranks
        are built."""
        if _is_engine_source(engine):
            return self.engine_link.build(engine, engine_type, actor, **engine_options)
        return self.engine_link.attach(engine, actor)

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
        """Generate for this rank's prompts across the engine's tensor-parallel group
        (:meth:`~lightrft.strategy.engine_link.generation.Generation.generate`:
        gathered, checked on every rank, generated once, each rank's own outputs back).
        Collective within the group.

        Our form: ``gather_and_generate(prompts, sampling)``. Upstream's form:
        ``gather_and_generate(sampling_params, all_prompt_token_ids=...)``, the sampling
        parameters positional or as ``sampling_params=`` (or ``all_prompts`` with
        ``all_images``/``images_num``/``all_videos``/``videos_num`` for multimodal
        engines; each prompt gets all of its items, in order; another registered
        modality comes with its own keywords, e.g. ``all_audios`` and ``audios_num``,
        see :mod:`lightrft.engines.multimodal`).

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
            return self.engine_link.generation.generate(
                prompts or [], sampling, sleep_after=bool(sleep_engine)
            )
        sampling_params = prompts
        if all_prompt_token_ids is None and all_prompts is None and sampling is not None:
            all_prompt_token_ids = sampling  # upstream's second positional argument
        if all_prompt_token_ids is None and all_prompts is None:
            raise TypeError(
                "gather_and_generate got no prompts: pass gather_and_generate(prompts, "
                "sampling) with a list of token-id lists, or upstream's "
                "gather_and_generate(sampling_params, all_prompt_token_ids=[...])"
            )
        inputs, refused = self._upstream_inputs(
            all_prompt_token_ids, all_prompts, all_images, images_num, all_videos, videos_num,
            _more_media(more_media),
        )  # fmt: skip
        if refused is None:  # upstream wakes the engine whole, whoever put it to sleep
            self.engine_link.sleep.wake_up()
        return self.engine_link.generation.generate(
            inputs, sampling_params, sleep_after=sleep_engine is not False, refused=refused
        )

    def _upstream_inputs(
        self,
        all_prompt_token_ids: Sequence[Sequence[int]] | None,
        all_prompts: Sequence[Any] | None,
        all_images: Sequence[Any] | None,
        images_num: Sequence[int] | None,
        all_videos: Sequence[Any] | None,
        videos_num: Sequence[int] | None,
        more: dict[str, tuple[Any, Any]],
    ) -> tuple[list[Any], Exception | None]:
        """The engine inputs of upstream's form, or the MediaError that refused them."""
        multimodal = any(x is not None for x in (all_images or ())) or any(
            x is not None for x in (all_videos or ())
        )
        multimodal = multimodal or any(items is not None for items, _ in more.values())
        if multimodal:
            from lightrft.engines.multimodal import MediaError

            try:
                return self._build_multimodal_inputs(
                    all_prompts=(
                        all_prompts if all_prompts is not None else list(all_prompt_token_ids or [])
                    ),
                    all_images=all_images, images_num=images_num,
                    all_videos=all_videos, videos_num=videos_num, **more,
                ), None  # fmt: skip
            except MediaError as exc:
                return [], exc
        if all_prompt_token_ids is not None:
            return list(all_prompt_token_ids), None
        return [{"prompt": text} for text in all_prompts or []], None

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
        :func:`~lightrft.strategy.engine_link.build_multimodal_inputs`). Override it (on
        the class or the instance, as upstream's audio example does) to build other
        inputs."""
        return build_multimodal_inputs(
            all_prompts, all_images, images_num, all_videos, videos_num, **more
        )


def _is_engine_source(obj: Any) -> bool:
    """What an engine is built from (None: the strategy's config; a mapping, an argparse
    namespace, a config or an EngineSpec, recognised by ``engine_type``/``pretrain``),
    as opposed to an engine object, checked against the protocol."""
    if obj is None or isinstance(obj, Mapping):
        return True
    if callable(getattr(obj, "generate", None)):
        return False
    return hasattr(obj, "engine_type") or hasattr(obj, "pretrain")


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
