"""An engine rank's life: build the engine the trainers ask for, then generate, take
weights and answer until the trainers close their strategy (or trainer rank 0 is gone).

Each request comes from trainer rank 0 and is handled to its end before the next is
read, so an engine never generates from a half-updated model: a sync's buckets and its
``finish`` arrive one after another, and a generation asked for meanwhile waits behind
them in the channel."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lightrft.strategy.engine_link.common import capabilities_module, limits

if TYPE_CHECKING:
    from lightrft.strategy.engine_ranks.channel import Channel

logger = logging.getLogger("lightrft.strategy.engine_ranks")

TRAINER = 0  # trainer rank 0's channel rank


def engine_info(engine: Any) -> dict[str, Any]:
    """What the trainers need to know of a built engine (its limits, dtype, shapes)."""
    offered = capabilities_module()
    vocab_size, max_model_len = limits(engine)
    shapes = engine.weight_shapes() if isinstance(engine, offered.WeightShapes) else None
    return {
        "name": type(engine).__name__,
        "vocab_size": vocab_size,
        "max_model_len": max_model_len,
        # "float32" or torch.float32 -> "float32" (the verification's tolerance reads it)
        "dtype": str(engine.dtype).removeprefix("torch.")
        if isinstance(engine, offered.ComputeDtype)
        else "float32",
        "weight_shapes": None if shapes is None else {k: tuple(v) for k, v in shapes.items()},
        "serves_adapters": isinstance(engine, offered.AdapterSync),
    }


class Server:
    """The engine rank's side of the channel: one engine, requests handled in order."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.engine: Any = None
        self.weight_version = 0
        self._sync_error: str | None = None  # a failed bucket, reported at ``finish``
        self.busy_s = 0.0  # seconds spent generating or loading weights
        # answers in flight: trainer rank 0 reads a generation's answer when it collects
        # it, maybe after sending a sync, which this rank must be free to read meanwhile
        self._in_flight: list[Any] = []

    def serve(self) -> None:
        """Handle requests until ``shutdown``; a lost trainer rank 0 raises."""
        while True:
            request = self.channel.receive(TRAINER)
            kind = request[0]
            started = time.perf_counter()
            if kind == "update":  # a bucket: its tensors follow; errors wait for finish
                tensors = self.channel.receive_tensors(request[2], TRAINER)
                self._load(list(zip(request[1], tensors, strict=True)))
            elif kind == "adapter":  # a LoRA adapter alone: its tensors follow
                tensors = self.channel.receive_tensors(request[2], TRAINER)
                self._reply(self._adapter, dict(zip(request[1], tensors, strict=True)),
                            request[3])  # fmt: skip
            elif kind == "close":  # the trainers closed their strategy
                self._reply(self._shutdown)
                for work, _ in self._in_flight:
                    work.wait()
                return
            else:
                self._reply(getattr(self, f"_{kind}"), *request[1:])
            self.busy_s += time.perf_counter() - started

    def _reply(self, handler: Any, *args: Any) -> None:
        try:
            answer: tuple[str, Any] = ("ok", handler(*args))
        except Exception as exc:  # the engine's own error: the trainers raise it
            logger.exception("engine rank request failed")
            answer = ("error", f"{type(exc).__name__}: {exc}")
        self._in_flight = [w for w in self._in_flight if not w[0].is_completed()]
        self._in_flight += self.channel.send(answer, TRAINER, wait=False)

    def _build(self, config: Any, engine_type: str | None, options: dict[str, Any]) -> Any:
        from lightrft.engines import build_engine

        if self.engine is not None:
            self.engine.shutdown()
        self.engine = build_engine(config, engine_type=engine_type, **options)
        self.weight_version = 0
        return engine_info(self.engine)

    def _generate(self, prompts: list[Any], sampling: Any) -> list[Any]:
        outputs = list(self.engine.generate(prompts, sampling)) if prompts else []
        if not isinstance(self.engine, capabilities_module().WeightVersion):
            for output in outputs:  # (an engine that counts its syncs has set it)
                output.weight_version = self.weight_version
        return outputs

    def _load(self, bucket: list[tuple[str, Any]]) -> None:
        if self._sync_error is not None:
            return
        try:
            self.engine.update_weights(bucket)
        except Exception as exc:
            logger.exception("engine rank: a weight bucket failed")
            self._sync_error = f"{type(exc).__name__}: {exc}"

    def _finish(self) -> int:
        error, self._sync_error = self._sync_error, None
        if error is not None:
            raise RuntimeError(f"a bucket of this sync failed: {error}")
        self.engine.finish_weight_update()
        self.weight_version += 1
        return self.weight_version

    def _adapter(self, tensors: dict[str, Any], settings: dict[str, Any]) -> int:
        self.engine.load_adapter(tensors, settings)
        self.weight_version += 1
        return self.weight_version

    def _stats(self) -> dict[str, float]:
        return {"busy_s": self.busy_s}

    def _shutdown(self) -> str:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return "bye"
