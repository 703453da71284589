"""`FakeEngine`: the inference-engine protocol with deterministic outputs, for tests.

Output rule (documented so tests can compute expected tokens): for a prompt with token
ids ``p``, sample ``k`` of ``n``, seed ``s`` (``SamplingParams.seed``, else 0) and the
engine's current ``weights_version``, output token ``j`` is::

    (sum(p) * 31 + len(p) * 17 + s * 1009 + k * 7919 + j * 131 + weights_version) % vocab_size

until ``max_new_tokens`` tokens (``finish_reason="length"``) or a token in
``stop_token_ids`` (included, ``finish_reason="stop"``). ``weights_version`` is 0 at
start and becomes a digest of the synced tensors after each completed weight sync, so
generations change when the weights do.

Sleep/wake follows :class:`lightrft.engines.protocol.SleepState`, the state machine
the real adapters use; every weight sync is recorded (name, shape, dtype and a SHA-256
of each tensor's bytes) so a test can check a sync sent exactly the right weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    Prompt,
    SamplingParams,
    SleepState,
    prompt_token_ids,
)


@dataclass(frozen=True)
class WeightRecord:
    """One tensor an engine received."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sha256: str


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's values (CPU, contiguous bytes)."""
    data = tensor.detach().to("cpu").contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


class FakeEngine:
    """An in-process engine: deterministic generations, sleep/wake levels enforced,
    weight syncs recorded.

    Args:
        vocab_size: token ids produced are below it.
        expected_weights: the parameter names a sync must send (each once); a name
            outside it, or a sync missing some, raises :class:`EngineError`. None
            accepts any names.
        supports_sleep: whether sleep/wake is available.
        generate_on_every_rank: whether each rank of a tensor-parallel group calls
            :meth:`generate` (as vLLM's external launcher) or only its first rank.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        expected_weights: Iterable[str] | None = None,
        supports_sleep: bool = True,
        generate_on_every_rank: bool = True,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"FakeEngine vocab_size={vocab_size} must be >= 2")
        self.vocab_size = vocab_size
        self.expected_weights = set(expected_weights) if expected_weights is not None else None
        self.supports_sleep = supports_sleep
        self.generate_on_every_rank = generate_on_every_rank
        self.state = SleepState(supports_sleep)
        self.weights_version = 0
        #: Completed syncs, oldest first: name -> WeightRecord.
        self.syncs: list[dict[str, WeightRecord]] = []
        #: Number of tensors in each update_weights call of the last completed sync.
        self.bucket_sizes: list[int] = []
        self._pending_buckets: list[int] = []
        self.generate_calls = 0
        self.closed = False
        self._pending: dict[str, WeightRecord] = {}

    # -- generation ------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingParams | None = None
    ) -> list[GenerationOutput]:
        self._check_open()
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        self.state.check_generate()
        self.generate_calls += 1
        seed = sampling.seed or 0
        stops = set(sampling.stop_token_ids)
        outputs = []
        for prompt in prompts:
            ids = prompt_token_ids(prompt)
            base = sum(ids) * 31 + len(ids) * 17 + seed * 1009 + self.weights_version
            for k in range(sampling.n):
                tokens: list[int] = []
                reason = "length"
                for j in range(sampling.max_new_tokens):
                    token = (base + k * 7919 + j * 131) % self.vocab_size
                    tokens.append(token)
                    if token in stops:
                        reason = "stop"
                        break
                outputs.append(GenerationOutput(ids, tokens, reason))
        return outputs

    # -- sleep / wake ------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        self._check_open()
        self.state.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._check_open()
        self.state.wake_up(tags)

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_open()
        self.state.check_update()
        count = 0
        for name, tensor in named_tensors:
            if self.expected_weights is not None and name not in self.expected_weights:
                self._pending, self._pending_buckets = {}, []  # the sync is abandoned
                raise EngineError(
                    f"update_weights: the engine has no parameter {name!r}; map training "
                    "names to the engine's (update_engine_weights(name_map=...))"
                )
            if name in self._pending:
                self._pending, self._pending_buckets = {}, []
                raise EngineError(f"update_weights: {name!r} sent twice in one sync")
            self._pending[name] = WeightRecord(
                name, tuple(tensor.shape), tensor.dtype, tensor_digest(tensor)
            )
            count += 1
        self._pending_buckets.append(count)

    def finish_weight_update(self) -> None:
        self._check_open()
        if self.expected_weights is not None:
            missing = sorted(self.expected_weights - set(self._pending))
            if missing:
                self._pending.clear()
                self._pending_buckets = []
                raise EngineError(f"weight sync incomplete: missing {missing}")
        record, self._pending = self._pending, {}
        self.bucket_sizes, self._pending_buckets = self._pending_buckets, []
        self.syncs.append(record)
        digest = hashlib.sha256("".join(r.sha256 for r in record.values()).encode()).hexdigest()
        self.weights_version = int(digest[:8], 16)
        self.state.weights_synced()

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise EngineError("the engine was shut down")
