"""DeepSpeed's engine files in a tag directory, read in one process, and written by a
job of CPU ranks (:mod:`.deepspeed_writer`).

Files (world size N; a ``bf16_`` prefix on the optimizer files in bf16 mode):

- stage 0: ``mp_rank_00_model_states.pt`` (``module``: full weights; ``optimizer``:
  torch's own ``state_dict()``, integer ids, no names; in bf16/fp16, DeepSpeed's FP16
  optimizer wrapper's: the fp32 master weights and torch's state of the masters);
- stages 1, 2: ``mp_rank_00_model_states.pt`` (``param_shapes``: per group, the names and
  shapes in layout order) and one ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per
  rank: the rank's slice of each group's flat fp32 vector (its tail padding stripped),
  and the base optimizer's state of that flat slice (moments still padded). DeepSpeed's
  BF16 optimizer (bf16 at stage 1 with fp32 gradient accumulation) writes the same
  layout to ``bf16_zero_pp_rank_...`` files, the last rank's slice keeping its padding;
- stage 3: one ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` and one ``..._optim_states.pt``
  per rank: per sub-group, for every parameter in order, the rank's piece of
  ``ceil(numel / N)`` elements (the last rank's padded with zeros).

Every file is loaded with ``torch.load(weights_only=True)``, allowing only the DeepSpeed
classes its checkpoints hold (see :mod:`lightrft.strategy.deepspeed.safe_checkpoint`).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightrft.strategy.checkpoint.layout import CheckpointError, CheckpointInfo
from lightrft.strategy.checkpoint.tools.contents import CheckpointContents, OptimizerContents

MOMENTS = ("exp_avg", "exp_avg_sq")
_RANK_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_(model|optim)_states\.pt")


def _load(path: Path) -> Any:
    try:
        from lightrft.strategy.deepspeed.safe_checkpoint import _allowed_globals
    except ImportError as exc:
        raise CheckpointError(
            f"reading the DeepSpeed checkpoint {path.parent} needs DeepSpeed's classes: "
            "pip install 'lightrft-strategy[deepspeed]'"
        ) from exc
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CheckpointError(
            f"cannot read {path} ({type(exc).__name__}: {first}); the file is corrupt or not "
            "a DeepSpeed checkpoint file written by LightRFT"
        ) from exc


def _rank_files(tag_dir: Path, kind: str) -> list[Path]:
    """``[bf16_]zero_pp_rank_{r}_mp_rank_00_<kind>_states.pt`` by rank, checked 0..N-1."""
    found: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = _RANK_FILE.fullmatch(path.name)
        if match and match.group(2) == kind:
            found[int(match.group(1))] = path
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(
            f"{tag_dir} has {kind}-state files for ranks {sorted(found)}, not 0..N-1: a rank's "
            "file is missing"
        )
    return [found[rank] for rank in range(len(found))]


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


class _Reader:
    """Collects full tensors by name: weights (fp32 master), moments, steps, groups."""

    def __init__(self, tag_dir: Path, shapes: Mapping[str, Any] | None = None) -> None:
        self.tag_dir = tag_dir
        self.shapes = dict(shapes or {})  # name -> shape, from the metadata
        self.weights: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.groups: list[dict[str, Any]] = []

    def put(self, name: str, key: str, tensor: torch.Tensor) -> None:
        if key == "fp32":
            self.weights[name] = tensor
        else:
            self.state.setdefault(name, {})[key] = tensor

    def put_state(self, name: str, state: Mapping[str, Any]) -> None:
        """One parameter's Adam state as torch keeps it (moments shaped as it is)."""
        for key in MOMENTS:
            if key in state:
                self.put(name, key, state[key].clone())
        self.put_step(name, state.get("step"))

    def put_step(self, name: str, step: Any) -> None:
        if step is not None:
            value = step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))
            self.state.setdefault(name, {})["step"] = value

    # -- stage 1 and 2 ---------------------------------------------------------------------
    def zero12(self, shards: list[dict[str, Any]], model: dict[str, Any]) -> None:
        aligns = shards[0].get("param_alignment_paddings")
        for g, shapes in enumerate(model["param_shapes"]):
            flat: dict[str, list[torch.Tensor]] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
            step, hyper = None, {}
            for shard in shards:
                lean = shard["single_partition_of_fp32_groups"][g]
                flat["fp32"].append(lean)
                base = shard["base_optimizer_state"]
                if isinstance(base, dict):
                    state = base["state"].get(base["param_groups"][g]["params"][0], {})
                    hyper = _hyperparameters(base["param_groups"][g])
                else:  # elastic checkpoints: lean per-group states, no hyperparameters
                    state = base[g]
                for key in MOMENTS:
                    if key in state:  # moments keep the rank's tail padding: cut it
                        flat[key].append(state[key].reshape(-1)[: lean.numel()])
                step = state.get("step", step)
            full = {k: torch.cat(v) for k, v in flat.items() if len(v) == len(shards)}
            offset, names = 0, []
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                if offset + numel > full["fp32"].numel():
                    raise CheckpointError(
                        f"{self.tag_dir}: group {g} holds {full['fp32'].numel()} values, but "
                        f"its parameters need more (at {name!r}); the files do not belong "
                        "together"
                    )
                for key, vector in full.items():
                    self.put(name, key, vector.narrow(0, offset, numel).view(shape).clone())
                self.put_step(name, step)
                offset += numel + (aligns[g][i] if aligns is not None else 0)
                names.append(name)
            self.groups.append({**hyper, "params": names})
        module = model.get("module") or {}
        for name in model.get("frozen_param_shapes") or {}:
            if name in module:
                self.weights[name] = module[name]

    # -- stage 3 ---------------------------------------------------------------------------
    def zero3(self, shards: list[dict[str, Any]], models: list[dict[str, Any]]) -> None:
        world = len(shards)
        param_shapes = models[0]["param_shapes"]
        base0 = shards[0]["optimizer_state_dict"]
        # torch numbers the flat sub-group tensors group by group
        sub_groups, start = [], 0
        for group in base0["param_groups"]:
            sub_groups.append(range(start, start + len(group["params"])))
            start += len(group["params"])
        if start != len(param_shapes):
            raise CheckpointError(
                f"{self.tag_dir}: {start} flat optimizer tensors but {len(param_shapes)} "
                "groups of parameter shapes; the files do not belong together"
            )
        for g, group in enumerate(base0["param_groups"]):
            names: list[str] = []
            for j, s in enumerate(sub_groups[g]):
                parts = {"fp32": [shard["fp32_flat_groups"][s] for shard in shards]}
                states = []
                for shard in shards:
                    torch_state = shard["optimizer_state_dict"]
                    pid = torch_state["param_groups"][g]["params"][j]
                    states.append(torch_state["state"].get(pid, {}))
                for key in MOMENTS:
                    if all(key in state for state in states):
                        parts[key] = [state[key].reshape(-1) for state in states]
                step = states[0].get("step")
                offset = 0
                for name, shape in param_shapes[s].items():
                    numel = math.prod(shape)
                    piece = math.ceil(numel / world)
                    for key, ranks in parts.items():
                        full = torch.cat([r.narrow(0, offset, piece) for r in ranks])
                        self.put(name, key, full[:numel].view(shape).clone())
                    self.put_step(name, step)
                    offset += piece
                    names.append(name)
            self.groups.append({**_hyperparameters(group), "params": names})
        for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
            pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
            self.weights[name] = torch.cat(pieces)[: math.prod(shape)].view(shape).clone()

    # -- stage 0 ---------------------------------------------------------------------------
    def zero0(
        self, model: dict[str, Any], group_names: list[list[str]] | None, optimizer: bool
    ) -> None:
        module, torch_state = model["module"], model.get("optimizer")
        buffers = set(model.get("buffer_names") or [])
        for name, tensor in module.items():
            if name not in buffers:
                self.weights[name] = tensor
        if torch_state is None:
            return
        if "optimizer_state_dict" in torch_state:  # bf16/fp16: DeepSpeed's wrapper
            self.zero0_mixed(torch_state, group_names, optimizer)
            return
        if not optimizer:
            return
        if group_names is None:
            if len(torch_state["param_groups"]) != 1:
                raise CheckpointError(
                    f"{self.tag_dir} is a ZeRO stage 0 checkpoint whose optimizer groups are "
                    "not named in its metadata (saved before lightrft-strategy 0.3); convert "
                    "it with --drop optimizer"
                )
            group_names = [[name for name in module if name not in buffers]]
        for group, names in zip(torch_state["param_groups"], group_names, strict=True):
            if len(group["params"]) != len(names):
                raise CheckpointError(
                    f"{self.tag_dir}: an optimizer group has {len(group['params'])} parameters, "
                    f"the metadata names {len(names)}"
                )
            for pid, name in zip(group["params"], names, strict=True):
                self.put_state(name, torch_state["state"].get(pid, {}))
            self.groups.append({**_hyperparameters(group), "params": list(names)})

    def zero0_mixed(
        self, wrapper: dict[str, Any], group_names: list[list[str]] | None, optimizer: bool
    ) -> None:
        """ZeRO stage 0 in bf16/fp16: DeepSpeed's FP16 optimizer wrapper holds the fp32
        master weights (the module holds their bf16/fp16 copies) and the Adam state of the
        masters, per parameter (``fp32_groups``: the unfused wrapper, around torch's
        optimizers) or one flat tensor per group (``fp32_groups_flat``: the fused one,
        around DeepSpeed's FusedAdam on CUDA), parameters in group order, unpadded."""
        if group_names is None:
            if not optimizer:
                return  # the weights are the module's (bf16/fp16) copies
            raise CheckpointError(
                f"{self.tag_dir} is a ZeRO stage 0 checkpoint in mixed precision whose "
                "metadata does not name the optimizer's groups (an earlier lightrft-strategy "
                "saved it): its fp32 master weights and Adam state cannot be told apart. "
                "Convert it with --drop optimizer (the module's bf16/fp16 weights), or resume "
                "it with this release and save again"
            )
        base = wrapper["optimizer_state_dict"]
        per_param = wrapper.get("fp32_groups")
        flats = wrapper.get("fp32_groups_flat")
        if len(base["param_groups"]) != len(group_names):
            raise CheckpointError(
                f"{self.tag_dir}: the optimizer has {len(base['param_groups'])} groups, the "
                f"metadata names {len(group_names)}"
            )
        for g, (group, names) in enumerate(zip(base["param_groups"], group_names, strict=True)):
            if per_param is not None:
                masters = [m.detach() for m in per_param[g]]
                states = [base["state"].get(pid, {}) for pid in group["params"]]
            else:
                masters, states = self._split_flat(g, flats, group, base["state"], names)
            if not len(masters) == len(states) == len(names):
                raise CheckpointError(
                    f"{self.tag_dir}: optimizer group {g} holds {len(masters)} master "
                    f"weights, the metadata names {len(names)}"
                )
            for name, master, state in zip(names, masters, states, strict=True):
                self.weights[name] = master
                if optimizer:
                    self.put_state(name, state)
            if optimizer:
                self.groups.append({**_hyperparameters(group), "params": list(names)})

    def _split_flat(
        self,
        g: int,
        flats: list[torch.Tensor] | None,
        group: dict[str, Any],
        torch_state: dict[Any, Any],
        names: list[str],
    ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The fused wrapper's group ``g``: one flat fp32 tensor (and flat moments), cut
        into the recorded parameters' shapes."""
        if flats is None:
            raise CheckpointError(
                f"{self.tag_dir}: DeepSpeed's optimizer wrapper holds neither fp32_groups nor "
                "fp32_groups_flat; a DeepSpeed release this command does not know wrote it"
            )
        if len(group["params"]) != 1:
            raise CheckpointError(
                f"{self.tag_dir}: optimizer group {g} of DeepSpeed's fused wrapper holds "
                f"{len(group['params'])} tensors, not one flat tensor"
            )
        flat, state = flats[g].detach(), torch_state.get(group["params"][0], {})
        shapes = [tuple(self.shapes[name]) for name in names]
        needed = sum(math.prod(shape) for shape in shapes)
        if needed != flat.numel():
            raise CheckpointError(
                f"{self.tag_dir}: optimizer group {g} holds {flat.numel()} values, its "
                f"recorded parameters {needed}; the files do not belong together"
            )
        flat_of = {
            "fp32": flat.reshape(-1),
            **{k: state[k].reshape(-1) for k in MOMENTS if k in state},
        }
        masters, states, offset = [], [], 0
        for shape in shapes:
            numel = math.prod(shape)
            cut = {k: t.narrow(0, offset, numel).view(shape).clone() for k, t in flat_of.items()}
            masters.append(cut.pop("fp32"))
            states.append({**cut, "step": state.get("step")})
            offset += numel
        return masters, states


def read_deepspeed(
    info: CheckpointInfo, optimizer: bool, progress: Callable[[str, int, int], None] | None = None
) -> CheckpointContents:
    """Full weights (fp32 master weights), buffers and (with ``optimizer``) Adam state of
    the DeepSpeed checkpoint ``info``, by parameter name, in one process."""
    try:
        return _read_deepspeed(info, optimizer, progress)
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{info.path} does not have the layout of the DeepSpeed checkpoints this command "
            f"reads ({type(exc).__name__}: {exc}); it was written by another DeepSpeed "
            "configuration or release, or a file was replaced"
        ) from exc


def _read_deepspeed(
    info: CheckpointInfo, optimizer: bool, progress: Callable[[str, int, int], None] | None
) -> CheckpointContents:
    tag_dir = info.path
    recorded = (info.metadata.get("model") or {}).get("parameters", [])
    reader = _Reader(tag_dir, {str(entry[0]): entry[1] for entry in recorded})
    optim_files = _rank_files(tag_dir, "optim")
    model_files = _rank_files(tag_dir, "model") if optim_files else []
    total = len(optim_files) + max(1, len(model_files))
    done = 0

    def load(path: Path) -> Any:
        nonlocal done
        loaded = _load(path)
        done += 1
        if progress is not None:
            progress("read", done, total)
        return loaded

    if not optim_files:
        model = load(tag_dir / "mp_rank_00_model_states.pt")
        reader.zero0(model, info.metadata.get("optimizer_groups"), optimizer)
    else:
        shards = [load(path)["optimizer_state_dict"] for path in optim_files]
        # DeepSpeed's BF16 optimizer (bf16 at ZeRO-1 with fp32 gradient accumulation)
        # records no stage; its files have the stage-1 layout (partitions of each group's
        # flat fp32 vector, the last one padded)
        stage = int(shards[0].get("zero_stage", 1))
        if stage <= 2:
            model = load(tag_dir / "mp_rank_00_model_states.pt")
            reader.zero12(shards, model)
        else:
            models = [load(path) for path in model_files]
            if len(models) != len(shards):
                raise CheckpointError(
                    f"{tag_dir} has {len(models)} model-state and {len(shards)} optimizer-state "
                    "files; a rank's file is missing"
                )
            model = models[0]
            reader.zero3(shards, models)
    module = model.get("module") or {}
    for name in model.get("buffer_names") or []:
        if name in module:
            reader.weights[name] = module[name]
    # parameters outside the optimizer (frozen ones) that the module's state holds whole
    # (ZeRO-1 records no frozen_param_shapes)
    for entry in (info.metadata.get("model") or {}).get("parameters", []):
        name = str(entry[0])
        if name not in reader.weights and name in module and module[name].numel():
            reader.weights[name] = module[name]
    # a tied name holds its source's value (at ZeRO-0 in mixed precision the module's
    # alias is the bf16/fp16 copy, the source the fp32 master; DeepSpeed records
    # shared_params only at stages 1-3)
    tied = dict(model.get("shared_params") or {})
    tied.update((info.metadata.get("model") or {}).get("tied") or {})
    for alias, source in tied.items():
        if source in reader.weights:
            reader.weights[alias] = reader.weights[source]
    contents = CheckpointContents(info, reader.weights)
    if optimizer and reader.state:
        contents.optimizer = OptimizerContents(reader.state, reader.groups)
    return contents


# -- writing: a job of CPU ranks running DeepSpeed ------------------------------------


def write_deepspeed(
    contents: CheckpointContents,
    tag_dir: Path,
    *,
    stage: int,
    world_size: int,
    precision: str = "fp32",
    timeout: float = 1800.0,
) -> None:
    """DeepSpeed's engine files for ``contents`` at ZeRO ``stage`` and ``world_size``,
    written by DeepSpeed itself: ``world_size`` CPU ranks (gloo) each build the model's
    parameters (from the recorded layout), set the full state into a fresh engine
    (:func:`lightrft.strategy.checkpoint.tools.deepspeed_writer.set_full_state`) and save."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        raise CheckpointError(
            "converting to DeepSpeed runs DeepSpeed: pip install 'lightrft-strategy[deepspeed]'"
        ) from exc
    meta = contents.info.metadata
    groups = (
        [dict(g) for g in contents.optimizer.param_groups]
        if contents.optimizer is not None
        else [{"params": names} for names in meta.get("optimizer_groups") or []]
    )
    payload = {
        "layout": meta["model"],
        "weights": contents.weights,
        "state": contents.optimizer.state if contents.optimizer is not None else {},
        "groups": groups,
        "stage": stage,
        "precision": precision,
    }
    # the state goes to the ranks through a file beside the output (not /tmp, which may
    # be small), memory-mapped by each rank
    with tempfile.TemporaryDirectory(prefix=".lightrft-convert-", dir=tag_dir.parent) as scratch:
        payload_file = Path(scratch) / "state.pt"
        torch.save(payload, payload_file)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env["CUDA_VISIBLE_DEVICES"] = ""  # written on CPU, whatever the machine has
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world_size}",
            "-m", "lightrft.strategy.checkpoint.tools.deepspeed_writer",
            str(payload_file), str(tag_dir),
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise CheckpointError(
                f"DeepSpeed's writers ({world_size} CPU ranks) did not finish in {timeout:.0f} "
                "s; nothing was kept"
            ) from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise CheckpointError(
            f"DeepSpeed's writers ({world_size} CPU ranks, ZeRO stage {stage}) failed with exit "
            f"status {done.returncode}; nothing was kept. Their last lines:\n{tail}"
        )
