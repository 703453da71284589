"""`FakeEngine`: the inference-engine protocol with deterministic outputs, for tests.

Output rule (documented so tests can compute expected tokens): for a prompt with token
ids ``p``, sample ``k`` of ``n`` and seed ``s`` (``SamplingParams.seed``, else 0),
output token ``j`` is::

    (sum(p) * 31 + len(p) * 17 + s * 1009 + k * 7919 + j * 131 + w[j % 8]) % vocab_size

until ``max_new_tokens`` tokens (``finish_reason="length"``) or a token in
``stop_token_ids`` (included, ``finish_reason="stop"``). ``w`` is a function of the
weights the engine holds and of nothing else: the eight 32-bit words of
``engine.weights_digest`` (``w[i] = int(weights_digest[8 * i : 8 * i + 8], 16)``), all
0 while it holds no weights. ``weights_digest`` is :func:`weights_digest` of
``engine.weights``: every name received by a completed sync with the record of the
latest tensor sent under it (a level-2 sleep discards them all, as a real engine
does). So syncing the same weights again (in any order or bucketing) leaves the
generations as they were, and changing any weight changes them.
``weights_version`` is ``w[0]``.

With a ``policy`` (a causal LM: ``policy(input_ids)`` gives logits, or an output with
``.logits``) the engine samples its completions from that model instead
(:mod:`lightrft.testing.policy_sampler`: greedy at temperature 0, seeded sampling,
``n``, stop ids, logprobs), and a completed sync copies the weights into it: so a loop
on the fake engine learns as on a real one. Built from a spec that names a model folder
(``pretrain``), it loads that model as its policy (native option
``sample_from_model=False``: the output rule).

With ``serves_adapters=True`` it also takes a LoRA adapter alone (``load_adapter``, the
:class:`~lightrft.engines.AdapterSync` capability): its tensors count among the
weights of the output rule, and a policy generates with ``W + scaling * B @ A`` on each
adapted weight (the base being what the last full sync, or the model, gave).

Sleep/wake follows :class:`lightrft.engines.protocol.SleepState`, the state machine
the real adapters use; every weight sync is recorded (name, shape, dtype and a SHA-256
of each tensor's bytes) so a test can check a sync sent exactly the right weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightrft.engines.base import EngineBase
from lightrft.engines.capabilities import PartialWeightSync, PromptLimits, WeightShapes
from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    Prompt,
    WeightMismatchError,
    as_sampling_params,
    check_weight_shapes,
    prompt_token_ids,
)

if TYPE_CHECKING:
    from lightrft.engines.spec import EngineSpec


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


def weights_digest(weights: Mapping[str, WeightRecord]) -> str:
    """SHA-256 (hex) of a set of weights: over each record's name, dtype, shape and
    tensor digest, in name order, so the order the tensors were sent in does not
    matter. ``""`` for no weights."""
    if not weights:
        return ""
    digest = hashlib.sha256()
    for name in sorted(weights):
        record = weights[name]
        line = f"{record.name}\0{record.dtype}\0{record.shape}\0{record.sha256}\n"
        digest.update(line.encode())
    return digest.hexdigest()


class FakeEngine(EngineBase, PromptLimits, WeightShapes, PartialWeightSync):
    """An in-process engine: generations a deterministic function of the prompt, the
    sampling parameters and the weights received (the module's output rule), sleep/wake
    levels enforced, weight syncs recorded.

    Args:
        vocab_size: token ids produced are below it.
        expected_weights: the parameter names a sync must send (each once); a name
            outside it, or a sync missing some, raises :class:`EngineError`. None
            accepts any names.
        supports_sleep: whether sleep/wake is available.
        generate_on_every_rank: whether each rank of a tensor-parallel group calls
            :meth:`generate` (as vLLM's external launcher) or only its first rank.
        policy: a causal LM to sample completions from (see the module docstring); its
            parameter names are then the names a sync must send (``expected_weights``),
            with their shapes.
        weight_stream: offer ``update_weights_stream`` (one call per sync pulling the
            tensors, as the vLLM adapter does), so the strategy streams to it instead
            of sending buckets.
        serves_adapters: offer ``load_adapter`` (a LoRA adapter alone, as vLLM and
            SGLang take one), so ``lora_sync="adapter"`` sends it the adapter.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        expected_weights: Iterable[str] | None = None,
        supports_sleep: bool = True,
        generate_on_every_rank: bool = True,
        policy: nn.Module | None = None,
        weight_stream: bool = False,
        serves_adapters: bool = False,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"FakeEngine vocab_size={vocab_size} must be >= 2")
        super().__init__(supports_sleep)
        self.vocab_size: int = vocab_size
        #: No length limit (prompts are checked against the vocabulary only).
        self.max_model_len: int | None = None
        self.policy = policy.eval() if policy is not None else None  # no dropout
        #: The policy's parameters by name (a tied weight once), which syncs replace.
        self._policy_params = dict(policy.named_parameters()) if policy is not None else {}
        if policy is not None and expected_weights is None:
            expected_weights = self._policy_params
        self.expected_weights = set(expected_weights) if expected_weights is not None else None
        self.generate_on_every_rank = generate_on_every_rank
        #: The weights held: name -> record of the latest tensor a completed sync sent
        #: under that name. Emptied by a level-2 sleep.
        self.weights: dict[str, WeightRecord] = {}
        #: :func:`weights_digest` of :attr:`weights`; the generations depend on it.
        self.weights_digest = ""
        #: The first 32-bit word of :attr:`weights_digest` (0 while no weights are held).
        self.weights_version = 0
        #: Completed syncs, oldest first: name -> WeightRecord.
        self.syncs: list[dict[str, WeightRecord]] = []
        #: Number of tensors in each update_weights call of the last completed sync.
        self.bucket_sizes: list[int] = []
        self._pending_buckets: list[int] = []
        self.generate_calls = 0
        #: The prompts of the last :meth:`generate` call, as received (media included).
        self.last_prompts: list[Prompt] = []
        self._pending: dict[str, WeightRecord] = {}
        self._pending_tensors: dict[str, torch.Tensor] = {}
        if weight_stream:  # an optional protocol member: present only when offered
            self.update_weights_stream = self._update_weights_stream
        #: The adapter held: name in peft's adapter file -> record (empty: none).
        self.adapter: dict[str, WeightRecord] = {}
        #: Its ``adapter_config.json`` settings, as received.
        self.adapter_settings: dict[str, Any] = {}
        self._adapter_base: dict[str, torch.Tensor] = {}  # adapted weight -> its base
        self._adapter_delta: dict[str, torch.Tensor] = {}  # adapted weight -> scaling*B@A
        if serves_adapters:
            self.load_adapter = self._load_adapter

    # -- generation ------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: EngineSpec) -> FakeEngine:
        """``build_engine(config, engine_type="fake")``: the spec's native options
        (``vocab_size``, ``expected_weights``, ``supports_sleep``,
        ``generate_on_every_rank``, ``weight_stream``, ``serves_adapters``) are the
        constructor's arguments; without
        ``vocab_size``, that of the model the spec names (its ``config.json``), so the
        token ids fit the model being trained."""
        options = dict(spec.native)
        sample = options.pop("sample_from_model", True)
        config = Path(spec.model_path or "") / "config.json"
        if spec.model_path and config.is_file():
            fields = json.loads(config.read_text())
            vocab = fields.get("vocab_size") or fields.get("text_config", {}).get("vocab_size")
            if "vocab_size" not in options and vocab:
                options["vocab_size"] = int(vocab)
            if sample and "policy" not in options:
                from lightrft.testing.policy_sampler import load_policy

                options["policy"] = load_policy(spec.model_path, spec.device)
        return cls(**options)

    @property
    def weight_version(self) -> int:
        """Finished syncs (every output carries it)."""
        return len(self.syncs)

    def generate(self, prompts: Sequence[Prompt], sampling: Any = None) -> list[GenerationOutput]:
        self._check_open()
        sampling = as_sampling_params(sampling)
        self.state.check_generate()
        self.generate_calls += 1
        self.last_prompts = list(prompts)
        if self.policy is not None:
            from lightrft.testing.policy_sampler import sample_completions

            token_lists = [prompt_token_ids(prompt) for prompt in prompts]
            return sample_completions(
                self.policy, token_lists, sampling, weight_version=self.weight_version
            )
        seed = sampling.seed or 0
        stops = set(sampling.stop_token_ids)
        outputs = []
        words = self._weight_words()
        for prompt in prompts:
            ids = prompt_token_ids(prompt)
            base = sum(ids) * 31 + len(ids) * 17 + seed * 1009
            for k in range(sampling.n):
                tokens: list[int] = []
                reason = "length"
                for j in range(sampling.max_new_tokens):
                    token = (base + k * 7919 + j * 131 + words[j % 8]) % self.vocab_size
                    tokens.append(token)
                    if token in stops:
                        reason = "stop"
                        break
                outputs.append(
                    GenerationOutput(ids, tokens, reason, weight_version=self.weight_version)
                )
        return outputs

    def _weight_words(self) -> list[int]:
        """``w`` of the output rule: the digest's eight 32-bit words, or zeros."""
        if not self.weights_digest:
            return [0] * 8
        return [int(self.weights_digest[8 * i : 8 * i + 8], 16) for i in range(8)]

    # -- sleep / wake ------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        if level == 2:  # the weights are discarded: generations wait for a new sync
            self._set_weights({})

    # -- weights -------------------------------------------------------------------------------
    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """With a policy: name -> shape of every parameter a sync must send; else None
        (the engine cannot tell)."""
        if self.policy is None:
            return None
        return {name: tuple(p.shape) for name, p in self._policy_params.items()}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._check_open()
        self.state.check_update()
        batch = list(named_tensors)
        shapes = self.weight_shapes()
        if shapes is not None:
            try:
                check_weight_shapes(shapes, {n: tuple(t.shape) for n, t in batch}, complete=False)
            except WeightMismatchError:
                self._abandon()
                raise
        count = 0
        for name, tensor in batch:
            if self.expected_weights is not None and name not in self.expected_weights:
                self._abandon()
                raise WeightMismatchError(unexpected=[name])
            if name in self._pending:
                self._abandon()
                raise EngineError(f"update_weights: {name!r} sent twice in one sync")
            if self.policy is not None:  # names and shapes checked above
                target = self._policy_params[name]
                self._pending_tensors[name] = tensor.detach().to(
                    target.device, target.dtype, copy=True
                )
            self._pending[name] = WeightRecord(
                name, tuple(tensor.shape), tensor.dtype, tensor_digest(tensor)
            )
            count += 1
        self._pending_buckets.append(count)

    def _update_weights_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``update_weights_stream`` (with ``weight_stream=True``): a whole sync in one
        call, each tensor checked as it is pulled; :attr:`bucket_sizes` is then one
        entry (this call)."""
        self._check_open()
        self.state.check_update()
        self._abandon()  # a whole sync of its own: nothing staged before it counts
        try:
            for item in named_tensors:
                self.update_weights([item])
        except BaseException:
            self._abandon()  # a failed stream leaves nothing staged
            raise
        self._pending_buckets = [len(self._pending)]
        self.finish_weight_update()

    def _abandon(self) -> None:
        """A refused sync leaves nothing staged (the weights held stay as they were)."""
        self._pending, self._pending_buckets, self._pending_tensors = {}, [], {}

    def finish_weight_update(self) -> None:
        self._finish(complete=True)

    def finish_partial_weight_update(self) -> None:
        """A sync of some weights (a LoRA model's changed layers): those are taken, the
        rest kept."""
        self._finish(complete=False)

    def _finish(self, complete: bool) -> None:
        self._check_open()
        if self.expected_weights is not None and complete:
            missing = sorted(self.expected_weights - set(self._pending))
            if missing:
                self._abandon()
                raise WeightMismatchError(missing=missing)
        record, self._pending = self._pending, {}
        tensors, self._pending_tensors = self._pending_tensors, {}
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in self._adapter_base:  # a new base under the adapter held
                    self._adapter_base[name] = tensor
                    tensor = tensor + self._adapter_delta[name]
                self._policy_params[name].copy_(tensor)
        self.bucket_sizes, self._pending_buckets = self._pending_buckets, []
        self.syncs.append(record)
        self._set_weights({**self.weights, **record})
        self.state.weights_synced(complete)

    def _load_adapter(
        self, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """``load_adapter`` (with ``serves_adapters=True``): the adapter replaces the one
        held; a policy's adapted weights become base + ``scaling * B @ A``."""
        self._check_open()
        self.state.check_update()
        rank, alpha = int(settings["r"]), float(settings["lora_alpha"])
        scaling = alpha / rank**0.5 if settings.get("use_rslora") else alpha / rank
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
            if match is None:
                raise EngineError(f"load_adapter: {name!r} is not a name of peft's adapter file")
            pairs.setdefault(f"{match[1]}.weight", {})[match[2]] = tensor
        halves = [n for n, pair in pairs.items() if len(pair) != 2]
        if halves:
            raise EngineError(f"load_adapter: {halves[:3]} came without lora_A or lora_B")
        if self.policy is not None:
            unknown = sorted(n for n in pairs if n not in self._policy_params)
            if unknown:
                raise WeightMismatchError(unexpected=unknown)
            fan = bool(settings.get("fan_in_fan_out"))
            with torch.no_grad():
                for name, base in self._adapter_base.items():  # the old adapter goes
                    self._policy_params[name].copy_(base)
                self._adapter_base, self._adapter_delta = {}, {}
                for name, pair in pairs.items():
                    param = self._policy_params[name]
                    delta = scaling * (pair["B"].float() @ pair["A"].float()).to(param.device)
                    delta = (delta.T if fan else delta).to(param.dtype)
                    self._adapter_base[name] = param.detach().clone()
                    self._adapter_delta[name] = delta
                    param.add_(delta)
        record = {n: WeightRecord(n, tuple(t.shape), t.dtype, tensor_digest(t))
                  for n, t in tensors.items()}  # fmt: skip
        self.adapter, self.adapter_settings = record, dict(settings)
        self.bucket_sizes = [len(record)]
        self.syncs.append(record)
        self._set_weights(
            {**{n: r for n, r in self.weights.items() if ".lora_" not in n}, **record}
        )
        self.state.weights_synced()

    def _set_weights(self, weights: dict[str, WeightRecord]) -> None:
        self.weights = weights
        self.weights_digest = weights_digest(weights)
        self.weights_version = self._weight_words()[0]
