"""The engine ranks as the trainer ranks see them: one object per trainer rank that
implements the inference-engine protocol, so the engine link (weight sync, generation,
verification) runs unchanged on it.

Trainer rank 0 speaks for all: generation gathers every trainer's prompts to it, it
sends them to the engine ranks and hands each trainer back its own outputs; a weight
sync's buckets go from it alone (the other trainer ranks still take part in gathering
the full tensors). Every call is collective over the trainer ranks, so an error (a bad
prompt, an engine's failure, an engine rank gone) is raised on every trainer rank."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightrft.strategy import roll_call
from lightrft.strategy.engine_link.common import protocol_module
from lightrft.strategy.lora import LoraError

if TYPE_CHECKING:
    from lightrft.strategy.engine_ranks.channel import Channel
    from lightrft.strategy.world import World


class EngineRankError(roll_call.CollectiveError):
    """An engine rank did not answer (its process is gone, or it stalled past the
    timeout): raised on every trainer rank, naming it (``missing``: job rank -> what
    became of it)."""


class RemoteEngine:
    """The engine on the job's engine ranks, for a trainer rank.

    Args:
        world: the trainer ranks' world.
        channel: the channel to the engine ranks (trainer rank 0 only; None elsewhere).
        engine_ranks: the job ranks that serve engines, in channel order.
    """

    tp_size = 1  # each trainer rank is its own slot: the engine ranks serve them all
    #: Generation is collective over the trainer ranks (a rank with no prompts too).
    collective = True

    def __init__(
        self, world: World, channel: Channel | None, engine_ranks: list[int], per_engine: int = 1
    ) -> None:
        self.world = world
        self.channel = channel
        self.engine_ranks = engine_ranks
        #: engine ranks per engine (``engine_tp_size``): each rank of an engine gets its
        #: prompts and generates them; the first one's outputs are kept
        self.per_engine = per_engine
        self.info: dict[str, Any] = {}
        self._version = 0
        self._sync_error: tuple[str, Any] | None = None  # a bucket's failure
        # submitted: each trainer rank's number of prompts, and the sampling
        self._pending: tuple[list[int], Any] | None = None
        # trainer rank 0: a submitted generation's answers, read early because another
        # request's answer came after them (each engine rank answers in order)
        self._early: dict[int, tuple[str, Any]] = {}
        self._awaiting = False  # a generation's answers are still to be read

    # -- what the link asks of an engine ----------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        return self.info.get("vocab_size")

    @property
    def max_model_len(self) -> int | None:
        return self.info.get("max_model_len")

    @property
    def dtype(self) -> str:
        return str(self.info.get("dtype", "float32"))

    @property
    def weight_version(self) -> int:
        """Syncs the engine ranks have finished."""
        return self._version

    def weight_shapes(self) -> dict[str, tuple[int, ...]] | None:
        return self.info.get("weight_shapes")

    # -- calls ----------------------------------------------------------------------------
    def build(self, config: Any, engine_type: str | None, options: dict[str, Any]) -> None:
        """Build the engine on every engine rank (from the config, as it is now on
        trainer rank 0: paths set after the strategy was made, such as ``pretrain``,
        reach the engine ranks). Collective over the trainer ranks.

        Off CUDA several tensor-parallel engines are built one after another: vLLM's
        CPU build names its shared-memory segments after the parallel group only, so
        two such engines starting together would take the same names (each removes its
        names once built)."""
        request = ("build", config, engine_type, options)
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:
            channel = self.channel
            in_turn = self.per_engine > 1 and channel.device.type != "cuda"
            senders = list(range(1, channel.size))
            groups = (
                [senders[i : i + self.per_engine] for i in range(0, len(senders), self.per_engine)]
                if in_turn
                else [senders]
            )

            def ask() -> list[Any]:
                answers = []
                for group in groups:
                    for to in group:
                        channel.send(request, to)
                    answers += [self._answer(channel.receive(i), i) for i in group]
                return answers

            outcome = self._guarded("build", ask)
        self.info = self._raise(self._share(outcome))[0]
        self._version = 0

    def generate(self, prompts: Sequence[Any], sampling: Any = None) -> list[Any]:
        """This trainer rank's outputs for its ``prompts`` (``n`` per prompt, in order),
        generated on the engine ranks with every other trainer rank's (after a
        submitted generation still in flight, which stays to be collected)."""
        every = self.world.all_gather_object(list(prompts))
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:

            def call() -> list[Any]:
                self._send_prompts(every, sampling)
                self._read_early()  # a submitted generation answers first
                return self._answers()

            outcome = self._guarded("generate", call)
        outputs = self._raise(self._share(outcome))
        return self._mine(outputs, [len(chunk) for chunk in every], sampling)

    def _mine(self, outputs: list[Any], counts: list[int], sampling: Any) -> list[Any]:
        """This trainer rank's share of every rank's outputs (``n`` per prompt)."""
        n = max(1, int(protocol_module().as_sampling_params(sampling).n))
        rank = self.world.get_rank()
        start = sum(counts[:rank]) * n
        return list(outputs[start : start + counts[rank] * n])

    def submit(self, prompts: Sequence[Any], sampling: Any = None) -> None:
        """Send this step's prompts of every trainer rank to the engine ranks, which
        start generating; :meth:`collect` returns the outputs. Collective."""
        if self._pending is not None:
            raise RuntimeError("a generation is already submitted: collect it first")
        every = self.world.all_gather_object(list(prompts))
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:
            outcome = self._guarded("generate", lambda: self._send_prompts(every, sampling))
            self._awaiting = outcome[0] == "ok"
        self._raise(self._share(outcome))
        self._pending = ([len(chunk) for chunk in every], sampling)

    def collect(self) -> list[Any]:
        """The outputs of the submitted generation for this trainer rank (waits for
        the engine ranks). Collective."""
        if self._pending is None:
            raise RuntimeError("nothing was submitted to collect")
        (counts, sampling), self._pending = self._pending, None
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:
            outcome = self._guarded("generate", self._receive_outputs)
        return self._mine(self._raise(self._share(outcome)), counts, sampling)

    def update_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One bucket, from trainer rank 0 to every engine rank (the other trainer ranks
        send nothing); a failure is raised at :meth:`finish_weight_update`."""
        if self.channel is None or self._sync_error is not None:
            return
        channel, bucket = self.channel, list(named_tensors)
        tensors = [tensor for _, tensor in bucket]
        layout = channel.layout(tensors)

        def send() -> None:
            for to in range(1, channel.size):
                channel.send(("update", [name for name, _ in bucket], layout), to)
                channel.send_tensors(tensors, to)

        outcome = self._guarded("update_weights", send)
        if outcome[0] != "ok":
            self._sync_error = outcome

    def finish_weight_update(self) -> None:
        """The sync is complete on every engine rank (or raises on every trainer)."""
        error, self._sync_error = self._sync_error, None
        if error is not None:
            outcome: tuple[str, Any] = error
        else:
            outcome = ("ok", None)
            if self.channel is not None:
                outcome = self._guarded("update_weights", lambda: self._ask_all(("finish",)))
        self._raise(self._share(outcome))
        self._version += 1

    def load_adapter(
        self, tensors: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
    ) -> None:
        """A LoRA adapter alone (``lora_sync="adapter"``), from trainer rank 0 to every
        engine rank, whose engine takes it (``load_adapter``); counts as a sync.
        Collective over the trainer ranks."""
        if not self.info.get("serves_adapters"):
            raise LoraError(
                f"lora_sync='adapter': {self.info.get('name', 'the engine')} on the engine "
                "ranks cannot serve LoRA adapters (it has no load_adapter); set "
                "lora_sync='merged' to send base + adapter merged under the base model's "
                "names, which every engine takes"
            )
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:
            channel, names = self.channel, list(tensors)
            values = [tensors[name] for name in names]

            def send() -> list[Any]:
                for to in range(1, channel.size):
                    channel.send(("adapter", names, channel.layout(values), dict(settings)), to)
                    channel.send_tensors(values, to)
                self._read_early()  # a generation in flight answers first
                return [self._answer(channel.receive(i), i) for i in range(1, channel.size)]

            outcome = self._guarded("load_adapter", send)
        self._raise(self._share(outcome))
        self._version += 1

    def stats(self) -> list[dict[str, float]]:
        """Each engine rank's seconds spent generating or loading weights. Collective."""
        return list(self._everyone("stats"))

    def sleep(self, level: int = 1) -> None:
        """Engines on their own ranks keep their memory (the config refuses sleep)."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing sleeps (see :meth:`sleep`)."""

    def shutdown(self) -> None:
        """Shut the engine down on every engine rank; they exit when the strategy closes."""
        if self.info:
            self._everyone("shutdown")
            self.info = {}

    # -- trainer rank 0's side ----------------------------------------------------------
    def _send_prompts(self, every: list[list[Any]], sampling: Any) -> None:
        assert self.channel is not None
        protocol = protocol_module()
        params = protocol.as_sampling_params(sampling)
        for rank, chunk in enumerate(every):  # before any engine rank generates
            for index, prompt in enumerate(chunk):
                if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
                    continue  # a text prompt: the engine tokenizes and checks it
                protocol.check_prompts(
                    [prompt], params, vocab_size=self.vocab_size,
                    max_model_len=self.max_model_len,
                    describe=lambda _, index=index, rank=rank: f"prompt {index} of rank {rank}",
                )  # fmt: skip
        everything = [prompt for chunk in every for prompt in chunk]
        engines = (self.channel.size - 1) // self.per_engine
        per = -(-len(everything) // engines) if everything else 0
        for i in range(self.channel.size - 1):  # the ranks of an engine get its share
            share = i // self.per_engine
            self.channel.send(("generate", everything[share * per : (share + 1) * per],
                               sampling), 1 + i)  # fmt: skip

    def _receive_outputs(self) -> list[Any]:
        assert self.channel is not None
        self._read_early()
        early, self._early = self._early, {}
        senders = range(1, self.channel.size)
        return self._engines_outputs([self._answer(early[i], i) for i in senders])

    def _answers(self) -> list[Any]:
        """Every engine rank's outputs of the request just sent, in prompt order."""
        assert self.channel is not None
        answers = [self._answer(self.channel.receive(i), i) for i in range(1, self.channel.size)]
        return self._engines_outputs(answers)

    def _engines_outputs(self, answers: list[Any]) -> list[Any]:
        """Every engine's outputs, in prompt order: the first rank's of each engine
        (its other ranks generated the same, as tensor-parallel workers)."""
        return [output for answer in answers[:: self.per_engine] for output in answer]

    def drop_in_flight(self) -> None:
        """Read and drop the answers of a generation submitted and never collected
        (trainer rank 0, before the engine ranks are told to close)."""
        if self.channel is not None:
            self._read_early()
            self._early, self._pending = {}, None

    def _read_early(self) -> None:
        """Read the submitted generation's answers (in order, before any later one)."""
        assert self.channel is not None
        if self._awaiting:
            self._early = {i: self.channel.receive(i) for i in range(1, self.channel.size)}
            self._awaiting = False

    def _ask_all(self, request: tuple[Any, ...]) -> list[Any]:
        assert self.channel is not None
        for to in range(1, self.channel.size):
            self.channel.send(request, to)
        self._read_early()  # a generation in flight answers first
        return [self._answer(self.channel.receive(i), i) for i in range(1, self.channel.size)]

    def _answer(self, answer: tuple[str, Any], sender: int) -> Any:
        status, value = answer
        if status != "ok":
            raise _EngineAnsweredError(f"engine rank {self.engine_ranks[sender - 1]}: {value}")
        return value

    def _everyone(self, kind: str, *args: Any) -> list[Any]:
        outcome: tuple[str, Any] = ("ok", None)
        if self.channel is not None:
            outcome = self._guarded(kind, lambda: self._ask_all((kind, *args)))
        return list(self._raise(self._share(outcome)))

    def _guarded(self, operation: str, call: Any) -> tuple[str, Any]:
        """Run ``call`` on trainer rank 0: its value, the engine's error, or the engine
        rank that did not answer, as an outcome every trainer rank can raise."""
        started = time.perf_counter()
        try:
            return ("ok", call())
        except _EngineAnsweredError as exc:
            return ("error", str(exc))
        except protocol_module().SamplingError as exc:  # a bad prompt or sampling setting
            return ("sampling", (type(exc).__name__, str(exc)))
        except RuntimeError as exc:  # the channel: an engine rank is gone or stalled
            if not roll_call.is_peer_failure(exc):
                raise
            waited = time.perf_counter() - started
            return ("lost", self._lost(operation, exc, waited))

    def _lost(self, operation: str, cause: BaseException, waited: float) -> tuple[Any, ...]:
        """What :class:`EngineRankError` says: (message, operation, missing)."""
        assert self.channel is not None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        gone = [rank for rank in self.engine_ranks if _process_gone(rank)]
        # a killed process closes its sockets before it shows as exited: look again
        deadline = time.monotonic() + (3.0 if "connection" in first.lower() else 0.0)
        while not gone and time.monotonic() < deadline:
            time.sleep(0.1)
            gone = [rank for rank in self.engine_ranks if _process_gone(rank)]
        missing = (
            {rank: "exited" for rank in gone}
            if gone
            else {rank: "did not answer" for rank in self.engine_ranks}
        )
        who = f"engine rank(s) {sorted(missing)} {'exited' if gone else 'did not answer'}"
        message = (
            f"{operation}: {who} (engine_placement separate) after {waited:.1f} s; the "
            f"channel timeout is {self.channel.timeout.total_seconds():g} s "
            f"(StrategyConfig.dist_timeout_s). Cause: {first}"
        )
        return (message, operation, missing)

    def _share(self, outcome: tuple[str, Any]) -> tuple[str, Any]:
        """Trainer rank 0's outcome on every trainer rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return outcome
        holder = [outcome]
        with roll_call.guard("engine ranks"):
            dist.broadcast_object_list(holder, src=0)
        return holder[0]

    @staticmethod
    def _raise(outcome: tuple[str, Any]) -> Any:
        status, value = outcome
        if status == "ok":
            return value
        if status == "sampling":
            protocol = protocol_module()
            raise getattr(protocol, value[0], protocol.SamplingError)(value[1])
        if status == "lost":
            message, operation, missing = value
            raise EngineRankError(message, operation, dist_rank(), missing)
        raise protocol_module().EngineError(value)


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _EngineAnsweredError(Exception):
    """An engine rank answered with its engine's error."""


def _process_gone(job_rank: int) -> bool:
    """Whether engine rank ``job_rank``'s process (on this host) has exited, as it
    recorded itself in the store when it started serving."""
    from lightrft.strategy import distributed

    store = distributed.group_store("engine-hosts/")
    key = str(job_rank)
    try:
        if store is None or not store.check([key]):
            return False
        host, _, pid = store.get(key).decode().partition(" ")
    except Exception:
        return False
    import socket

    return host == socket.gethostname() and roll_call._exited(int(pid))
