"""The SGLang adapter against the installed SGLang (engines(sglang) session).

SGLang imports on CPU but cannot serve there. So: every name the adapter imports is
imported from the installed SGLang, every call it makes is bound to the installed
function's signature, and its own logic (buckets, serialization, sessions, tag order,
output conversion, version refusal, process containment) runs against a stand-in
whose methods are generated from the real ``Engine``'s signatures
(:func:`lightrft.testing.stand_in.stand_in`). Behind the stand-in, SGLang's receiving
side is emulated with SGLang's own classes (its serializer, ``LocalSerializedTensor``,
``FlattenedTensorBucket``) feeding a transformers model, so the weights it ends up with
and what it generates are checked against the trainer's. A real ``sglang.Engine`` runs
in the test marked ``gpu`` (test_sglang_gpu.py).
"""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightrft.engines import EngineError, SamplingParams
from lightrft.engines import sglang as adapter
from lightrft.engines.sglang_api import (
    CALLS,
    FLATTENED_CALLS,
    SESSION_CALLS,
    SGLangAPI,
    SGLangAPIError,
    load_api,
    version_tuple,
)
from lightrft.testing.models import greedy_reference
from lightrft.testing.stand_in import stand_in

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(600)]

ENGINE_METHODS = [
    "generate", "update_weights_from_tensor", "release_memory_occupation",
    "resume_memory_occupation", "flush_cache", "shutdown", "begin_weight_update",
    "end_weight_update", "load_lora_adapter_from_tensors", "unload_lora_adapter",
]  # fmt: skip


@pytest.fixture(scope="module")
def api() -> SGLangAPI:
    return load_api()


class SGLangSide:
    """What SGLang's Engine and its TP workers do with the adapter's calls, on CPU: the
    payloads go through SGLang's own serializer and tensor classes, once per TP rank
    as its workers unwrap them, into a transformers model. Released weights are not kept
    (a release keeps no parameters): here a resume brings back the initial ones, so
    serving them would be the stale-weights bug."""

    def __init__(self, api: SGLangAPI, model_dir: Path, tp_size: int = 1) -> None:
        from transformers import AutoModelForCausalLM

        self.api = api
        self.tp_size = tp_size
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.session = False
        self.released: set[str] = set()
        self.loaded_names: list[str] = []
        self.children: list[subprocess.Popen[bytes]] = []
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # name -> weight -> delta

    def construct(self, engine: Any, **server: Any) -> None:
        self.server = server

    def begin_weight_update(self, engine: Any, selector: str = "all") -> tuple[bool, str]:
        self.session = True
        return True, "Success"

    def end_weight_update(self, engine: Any) -> tuple[bool, str]:
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(
        self, engine: Any, named_tensors: Any, load_format: str | None, flush_cache: bool
    ) -> tuple[bool, str]:
        if self.api.weight_update_session and not self.session:  # as 0.5.23 answers
            return False, "update_weights_from_tensor must run between begin_weight_update()"
        serializer = self.api["MultiprocessingSerializer"]
        per_rank: list[dict[str, torch.Tensor]] = []
        if load_format == "flattened_bucket":
            payloads = self.api["normalize_payloads"](named_tensors)
            assert len(payloads) == self.tp_size, "one payload per TP rank"
            for payload in payloads:
                data = serializer.deserialize(payload)
                bucket = self.api["FlattenedTensorBucket"](
                    flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
                )
                per_rank.append(dict(bucket.reconstruct_tensors()))
        else:
            assert load_format is None
            payload = serializer.serialize(named_tensors)  # what Engine sends each worker
            for rank in range(self.tp_size):
                items = serializer.deserialize(payload)
                per_rank.append({name: value.get(rank) for name, value in items})
        for tensors in per_rank[1:]:
            assert tensors.keys() == per_rank[0].keys()
            assert all(torch.equal(tensors[k], per_rank[0][k]) for k in tensors)
        params = dict(self.model.named_parameters())
        unknown = [name for name in per_rank[0] if name not in params]
        if unknown:
            return False, f"unknown parameters {unknown}"
        with torch.no_grad():
            for name, tensor in per_rank[0].items():
                params[name].copy_(tensor)
                self.loaded_names.append(name)
        return True, "Success"

    def load_lora_adapter_from_tensors(
        self, engine: Any, lora_name: str, tensors: Any, config_dict: dict[str, Any],
        load_format: str | None = None,
    ) -> tuple[bool, str]:  # fmt: skip
        if lora_name in self.adapters:
            return False, f"LoRA adapter {lora_name!r} is already loaded"
        scaling = config_dict["lora_alpha"] / config_dict["r"]
        params = dict(self.model.named_parameters())
        deltas: dict[str, torch.Tensor] = {}
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            weight = name[len("base_model.model.") :].replace(".lora_A.weight", ".weight")
            if weight not in params:
                return False, f"unknown LoRA target {weight}"
            deltas[weight] = scaling * tensors[name.replace(".lora_A.", ".lora_B.")] @ a
        self.adapters[lora_name] = deltas
        return True, "Success"

    def unload_lora_adapter(self, engine: Any, lora_name: str) -> tuple[bool, str]:
        if self.adapters.pop(lora_name, None) is None:
            return False, f"LoRA adapter {lora_name!r} is not loaded"
        return True, "Success"

    def release_memory_occupation(self, engine: Any, tags: list[str] | None) -> None:
        self.released.update(tags or ["weights", "kv_cache", "cuda_graph"])

    def resume_memory_occupation(self, engine: Any, tags: list[str] | None) -> None:
        for tag in tags or ["weights", "kv_cache", "cuda_graph"]:
            self.released.discard(tag)
            if tag == "weights":
                self.model.load_state_dict(self.initial)  # not the weights last synced

    def generate(self, engine: Any, **request: Any) -> list[dict[str, Any]]:
        assert not self.released, f"generate with {sorted(self.released)} released"
        outs = []
        names = request.get("lora_path") or [None] * len(request["input_ids"])
        weights = dict(self.model.named_parameters())
        for ids, params, name in zip(
            request["input_ids"], request["sampling_params"], names, strict=True
        ):
            deltas = self.adapters[name] if name is not None else {}  # KeyError: unknown
            with torch.no_grad():
                for weight, delta in deltas.items():
                    weights[weight].add_(delta)
                tokens, logprobs = _decode(self.model, ids, params)
                for weight, delta in deltas.items():
                    weights[weight].sub_(delta)
            meta: dict[str, Any] = {"finish_reason": {"type": "length", "length": len(tokens)}}
            if request.get("return_logprob"):
                meta["output_token_logprobs"] = [
                    (lp, t, None) for lp, t in zip(logprobs, tokens, strict=True)
                ]
            outs.append({"output_ids": tokens, "meta_info": meta})
        self.requests = request
        return outs

    def shutdown(self, engine: Any) -> None:
        from sglang.srt.utils import kill_process_tree  # what Engine.shutdown does

        kill_process_tree(os.getpid(), include_parent=False, wait_timeout=30)


def _decode(model: Any, ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float]]:
    generator = torch.Generator().manual_seed(params.get("sampling_seed") or 0)
    sequence, tokens, logprobs = list(ids), [], []
    with torch.no_grad():
        for _ in range(params["max_new_tokens"]):
            logits = model(torch.tensor([sequence])).logits[0, -1].float()
            log_probs = torch.log_softmax(logits, dim=-1)
            if params["temperature"] == 0:
                token = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / params["temperature"], dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(log_probs[token]))
            sequence.append(token)
    return tokens, logprobs


def _reference(model_dir: Path, state: dict[str, torch.Tensor], prompts: list[list[int]]) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    return greedy_reference(model, prompts, 6)


def _engine(api: SGLangAPI, side: SGLangSide, **kwargs: Any) -> adapter.SGLangEngine:
    """The adapter around a stand-in generated from the installed Engine's signatures."""
    stand_in_class = stand_in(api["Engine"], side, methods=ENGINE_METHODS)
    names = {**api.names, "Engine": stand_in_class}
    stand_api = SGLangAPI(api.version, names, api.weight_update_session, api.flattened_bucket)
    engine = stand_api.call(stand_in_class, "Engine", "", model_path="m", tp_size=1)
    return adapter.SGLangEngine(engine, stand_api, vocab_size=512, max_model_len=128, **kwargs)


def _trained(model_dir: Path) -> dict[str, torch.Tensor]:
    """Weights that differ from the saved ones (and change greedy decoding)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():  # a tied weight once
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _adapter(
    model_dir: Path, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """A rank-8 adapter on q_proj and up_proj in peft's file names, its settings, and
    the merged state of the saved model it makes."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tensors = {}
    for name, weight in model.named_parameters():
        if not name.endswith(("q_proj.weight", "up_proj.weight")):
            continue
        a = 0.3 * torch.randn(8, weight.shape[1], generator=generator)
        b = 0.3 * torch.randn(weight.shape[0], 8, generator=generator)
        prefix = "base_model.model." + name[: -len(".weight")]
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
        state[name] = state[name] + 2.0 * b @ a  # alpha 16 / rank 8
    settings = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "up_proj"]}
    return tensors, settings, state


def _parameter_names(state: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in state if k != "lm_head.weight"]


def _sync(engine: adapter.SGLangEngine, state: dict[str, torch.Tensor], bucket: int) -> None:
    items = [(k, state[k]) for k in _parameter_names(state)]  # tied lm_head: not a parameter
    for start in range(0, len(items), bucket):
        engine.update_weights(items[start : start + bucket])
    engine.finish_weight_update()


# -- the installed SGLang --------------------------------------------------------------
def test_every_name_and_call_of_the_adapter_exists_in_the_installed_sglang(
    api: SGLangAPI,
) -> None:
    import sglang

    assert api.version == sglang.__version__
    assert version_tuple(api.version) >= (0, 5, 23)
    assert api.weight_update_session and api.flattened_bucket  # what 0.5.23 has
    # every SGLang call in the adapter's source is one load_api checked
    checked = {(owner, method) for owner, method, _ in (*CALLS, *SESSION_CALLS, *FLATTENED_CALLS)}
    made = set()
    for node in ast.walk(ast.parse(inspect.getsource(adapter))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
            "call",
            "check_call",
        ):
            strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
            made.add((strings[0], strings[1]))
    assert made and made <= checked, made - checked


def test_every_key_of_sglangs_sampling_params_reaches_sglang(api: SGLangAPI) -> None:
    """A sampling dict's keys that SGLang knows go to the engine unchanged
    (``SamplingParams.native``); the protocol's list must hold all of them."""
    from lightrft.engines.protocol import SGLANG_SAMPLING_KEYS

    internal = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                "is_normalized", "ebnf_full_assistant"}  # set by SGLang itself  # fmt: skip
    accepted = set(inspect.signature(api["SamplingParams"]).parameters) - internal
    assert accepted - SGLANG_SAMPLING_KEYS == set()


def test_a_version_outside_the_supported_range_is_refused_by_name() -> None:
    for version in ("0.5.22", "0.6.0"):
        with pytest.raises(SGLangAPIError, match=rf"SGLang {version} is installed; the "
                           r"adapter supports sglang>=0.5.23,<0.6"):  # fmt: skip
            load_api(version=version)


def test_a_call_that_no_longer_binds_names_the_version_the_range_and_the_call(
    api: SGLangAPI,
) -> None:
    class Renamed:  # an SGLang whose update call lost `load_format`
        def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool = True) -> None:
            raise AssertionError("not called")

    moved = SGLangAPI(api.version, {**api.names, "Engine": Renamed}, False, False)
    expected = (rf"SGLang {api.version} \(supported: >=0.5.23,<0.6\): "
                r"Engine.update_weights_from_tensor.*load_format")  # fmt: skip
    with pytest.raises(SGLangAPIError, match=expected):
        moved.call(Renamed(), "Engine", "update_weights_from_tensor", named_tensors=[],
                   load_format=None, flush_cache=False)  # fmt: skip


def test_server_arguments_bind_to_the_installed_server_args(api: SGLangAPI) -> None:
    api.check_call("ServerArgs", "", {"model_path": "m", "context_length": 64})
    with pytest.raises(SGLangAPIError, match=r"ServerArgs\(\.\.\.\).*no_such_option"):
        api.check_call("ServerArgs", "", {"no_such_option": 1})


# -- the adapter's logic against the stand-in ---------------------------------------------
@pytest.mark.parametrize("flattened", [True, False], ids=["flattened-bucket", "per-tensor"])
def test_sync_then_generate_equals_transformers_on_the_synced_weights(
    api: SGLangAPI, tiny_model_dir: Path, flattened: bool
) -> None:
    if flattened and not api.flattened_bucket:
        pytest.fail(f"SGLang {api.version} has no flattened buckets")
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side)
    engine.api.flattened_bucket = flattened
    prompts = [[5, 17, 99, 3], [42]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0, logprobs=True)
    before = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    state = _trained(tiny_model_dir)
    _sync(engine, state, bucket=5)
    got = dict(side.model.state_dict())
    assert all(torch.equal(got[k], state[k]) for k in state if k != "lm_head.weight")
    outs = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in outs] == _reference(tiny_model_dir, state, prompts)
    assert [o.output_token_ids for o in outs] != before, "the sync changed nothing"
    assert [o.prompt_token_ids for o in outs] == prompts and outs[0].weight_version == 1
    assert outs[0].logprobs is not None and len(outs[0].logprobs) == 6
    calls = [name for name, _ in engine.engine.calls]
    updates = [args for name, args in engine.engine.calls if name == "update_weights_from_tensor"]
    assert calls.count("begin_weight_update") == calls.count("end_weight_update") == 1
    first, last = calls.index("update_weights_from_tensor"), calls.index("end_weight_update")
    assert calls.index("begin_weight_update") < first and last < calls.index("flush_cache")
    assert all(u["flush_cache"] is False for u in updates) and calls.count("flush_cache") == 1
    fmt = "flattened_bucket" if flattened else None
    assert {u["load_format"] for u in updates} == {fmt}
    assert len(updates) == -(-len(_parameter_names(state)) // 5)  # buckets of 5 tensors


def test_an_adapter_reaches_sglang_and_every_request_names_it(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side, lora_rank=8)
    prompts = [[5, 17, 99, 3], [42]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    base = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    assert side.requests.get("lora_path") is None  # no adapter yet: none named
    for version, seed in ((1, 1), (2, 2)):
        tensors, settings, merged = _adapter(tiny_model_dir, seed)
        engine.load_adapter(tensors, settings)
        outs = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        assert outs == _reference(tiny_model_dir, merged, prompts) != base
        assert side.requests["lora_path"] == [f"lightrft-v{version}"] * 2
        assert list(side.adapters) == [f"lightrft-v{version}"]  # the old one unloaded
        assert engine.weight_version == version
    loads = [args for name, args in engine.engine.calls
             if name == "load_lora_adapter_from_tensors"]  # fmt: skip
    assert loads[-1]["config_dict"]["peft_type"] == "LORA"
    plain = _engine(api, SGLangSide(api, tiny_model_dir))
    with pytest.raises(
        EngineError, match=r"SGLang was started without adapters.*lora_sync=.adapter."
    ):
        plain.load_adapter(tensors, settings)
    with pytest.raises(EngineError, match=r"started for rank <= 8, and the adapter has rank 16"):
        engine.load_adapter(tensors, {**settings, "r": 16})
    side.adapters["lightrft-v3"] = {}  # SGLang refuses a name it holds: the error says so
    with pytest.raises(EngineError, match="SGLang refused load_lora_adapter_from_tensors"):
        engine.load_adapter(tensors, settings)
    assert [o.output_token_ids for o in engine.generate(prompts, greedy)] == outs


def test_n_samples_seeds_and_images_reach_sglang_per_request(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side)
    prompts: list[Any] = [[5, 17], {"prompt_token_ids": [42], "multi_modal_data": {
        "image": ["a.png", "b.png"]}}]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=7, stop_token_ids=(9,))
    outs = engine.generate(prompts, sampling)
    request = side.requests
    assert [o.prompt_token_ids for o in outs] == [[5, 17], [5, 17], [42], [42]]
    assert [p["sampling_seed"] for p in request["sampling_params"]] == [7, 8, 9, 10]
    assert all(p["stop_token_ids"] == [9] for p in request["sampling_params"])
    assert request["image_data"] == [None, None, ["a.png", "b.png"], ["a.png", "b.png"]]
    assert request["video_data"] is None
    passed = next(args for name, args in engine.engine.calls if name == "generate")
    assert "video_data" not in passed  # not sent at all when no prompt has a video
    again = engine.generate(prompts, sampling)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outs]


def test_a_registered_modality_reaches_sglang_by_its_keyword(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    from lightrft.engines.multimodal import Modality, register_modality, unregister_modality

    register_modality(Modality("audio", "all_audios", "audios_num", "audio_data"))
    try:
        side = SGLangSide(api, tiny_model_dir)
        engine = _engine(api, side)
        prompts: list[Any] = [{"prompt_token_ids": [4], "multi_modal_data": {"audio": ["x.wav"]}},
                              [5]]  # fmt: skip
        engine.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0))
        assert side.requests["audio_data"] == [["x.wav"], None]  # bound to Engine.generate
        assert side.requests["image_data"] is None
    finally:
        unregister_modality("audio")


def test_a_refused_update_is_an_error_naming_sglangs_answer(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side)
    with pytest.raises(EngineError, match=r"SGLang refused update_weights_from_tensor: "
                       r"unknown parameters \['not.a.weight'\]"):  # fmt: skip
        engine.update_weights([("not.a.weight", torch.ones(2))])


def test_level_2_sleep_then_wake_cannot_bring_back_old_weights(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side, sleep_mode=True)
    prompts = [[5, 17, 99, 3]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    state = _trained(tiny_model_dir)
    _sync(engine, state, bucket=100)
    trained = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    engine.sleep(2)
    assert side.released == {"kv_cache", "cuda_graph", "weights"}
    engine.wake_up(["weights"])  # the stand-in brings back its initial weights here
    with pytest.raises(EngineError, match="kv_cache asleep"):
        engine.generate(prompts, greedy)
    engine.wake_up(["kv_cache"])
    with pytest.raises(EngineError, match="stale weights"):
        engine.generate(prompts, greedy)  # never the initial weights' output
    _sync(engine, state, bucket=100)
    assert [o.output_token_ids for o in engine.generate(prompts, greedy)] == trained
    resumes = [args["tags"] for name, args in engine.engine.calls if name.startswith("resume")]
    assert resumes == [["weights"], ["kv_cache", "cuda_graph"]]


def test_an_interrupted_sync_refuses_generation_until_a_full_one(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    """SGLang loads each bucket as it comes: a sync that stops after some buckets (the
    trainer's gather raised, say) leaves old and new weights mixed."""
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side)
    prompts = [[5, 17, 99, 3]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    state = _trained(tiny_model_dir)
    items = [(k, state[k]) for k in _parameter_names(state)]
    engine.update_weights(items[:3])  # no finish_weight_update
    with pytest.raises(EngineError, match="a sync replaced some of them and did not finish"):
        engine.generate(prompts, greedy)
    _sync(engine, state, bucket=100)
    assert len(engine.generate(prompts, greedy)) == 1


def test_level_1_sleep_keeps_the_weights(api: SGLangAPI, tiny_model_dir: Path) -> None:
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side, sleep_mode=True)
    state = _trained(tiny_model_dir)
    _sync(engine, state, bucket=100)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    trained = [o.output_token_ids for o in engine.generate([[3, 4]], greedy)]
    engine.sleep(1)
    assert side.released == {"kv_cache", "cuda_graph"}
    engine.wake_up()
    assert [o.output_token_ids for o in engine.generate([[3, 4]], greedy)] == trained
    resumes = [args["tags"] for name, args in engine.engine.calls if name.startswith("resume")]
    assert resumes == [["kv_cache", "cuda_graph"]]  # the weights were never released


# -- what SGLang does to the training process ---------------------------------------------
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def test_environment_and_start_method_are_restored_and_sglangs_processes_recorded() -> None:
    os.environ.pop("NCCL_NVLS_ENABLE", None)
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # the user's own value
    method = multiprocessing.get_start_method(allow_none=True)
    contained = adapter._Contained()
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # what SGLang's Engine does
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    multiprocessing.set_start_method("spawn" if method != "spawn" else "fork", force=True)
    child = subprocess.Popen(SLEEPER)
    try:
        changed = contained.restore()
        assert changed == {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
        assert "NCCL_NVLS_ENABLE" not in os.environ
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        assert multiprocessing.get_start_method(allow_none=True) == method
        assert contained.started == [child.pid]
    finally:
        child.kill()
        child.wait()
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)


def test_shutdown_ends_sglangs_processes_and_leaves_the_trainers(
    api: SGLangAPI, tiny_model_dir: Path
) -> None:
    trainer_child = subprocess.Popen(SLEEPER)  # a data loader worker, say
    before = adapter._children()
    sglang_child = subprocess.Popen(SLEEPER)  # a scheduler SGLang started
    side = SGLangSide(api, tiny_model_dir)
    engine = _engine(api, side, started=sorted(set(adapter._children()) - set(before)))
    stand = engine.engine
    try:
        engine.shutdown()
        assert sglang_child.wait(timeout=60) is not None
        assert trainer_child.poll() is None, "SGLang's shutdown would have killed it"
        assert "shutdown" not in [name for name, _ in stand.calls]
    finally:
        trainer_child.kill()
        trainer_child.wait()
    alone = _engine(api, SGLangSide(api, tiny_model_dir))
    stand = alone.engine
    alone.shutdown()  # no other children: SGLang's own shutdown runs
    assert [name for name, _ in stand.calls][-1] == "shutdown"
    with pytest.raises(EngineError, match="shut down"):
        alone.generate([[1]])


# -- a tensor-parallel group of two training ranks ------------------------------------------
def _two_ranks(model_dir: str, flattened: bool) -> dict[str, Any]:
    import torch.distributed as dist

    # CPU tensors travel between the ranks' processes by shared-memory file here (CUDA
    # IPC handles on GPUs)
    torch.multiprocessing.set_sharing_strategy("file_system")
    api = load_api()
    api.flattened_bucket = flattened and api.flattened_bucket
    group = dist.new_group([0, 1], backend="gloo")
    state = _trained(Path(model_dir))
    if dist.get_rank() == 0:
        side = SGLangSide(api, Path(model_dir), tp_size=2)
        engine = _engine(api, side, tp_size=2, group=group, leader=True)
    else:
        engine = adapter.SGLangEngine(None, api, tp_size=2, group=group, leader=False)
    _sync(engine, state, bucket=7)
    out: dict[str, Any] = {"version": engine.weight_version}
    if dist.get_rank() == 0:
        got = side.model.state_dict()
        out["exact"] = all(torch.equal(got[k], state[k]) for k in state if k != "lm_head.weight")
        out["loaded"] = side.loaded_names == _parameter_names(state)
        greedy = SamplingParams(max_new_tokens=6, temperature=0)
        out["tokens"] = [o.output_token_ids for o in engine.generate([[5, 17, 99, 3]], greedy)]
        out["reference"] = _reference(Path(model_dir), state, [[5, 17, 99, 3]])
    else:
        with pytest.raises(EngineError, match="not its group's leader"):
            engine.generate([[1]])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("flattened", [True, False], ids=["flattened-bucket", "per-tensor"])
def test_two_ranks_each_send_their_copy_and_the_leader_loads_both(
    tiny_model_dir: Path, flattened: bool
) -> None:
    from lightrft.testing.launcher import run_distributed

    ranks = run_distributed(_two_ranks, 2, str(tiny_model_dir), flattened, timeout=400)
    assert ranks[0]["exact"] and ranks[0]["loaded"]  # each TP rank's copy, equal
    assert ranks[0]["tokens"] == ranks[0]["reference"]
    assert ranks[0]["version"] == ranks[1]["version"] == 1


def _leader_fails(model_dir: str) -> str:
    from lightrft.engines import EngineSpec

    api = load_api()

    class Refuses:
        def construct(self, engine: Any, **server: Any) -> None:
            raise RuntimeError("no CUDA device")

    api.names = {**api.names, "Engine": stand_in(api["Engine"], Refuses(), methods=[])}
    adapter.load_api = lambda: api  # type: ignore[assignment]  # this rank's process only
    spec = EngineSpec(engine_type="sglang", model_path=model_dir, tp_size=2, device="cuda")
    try:
        adapter.SGLangEngine.from_spec(spec)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "started"


@pytest.mark.distributed
def test_a_leader_whose_sglang_fails_to_start_does_not_leave_its_group_waiting(
    tiny_model_dir: Path,
) -> None:
    from lightrft.testing.launcher import run_distributed

    ranks = run_distributed(_leader_fails, 2, str(tiny_model_dir), timeout=300)
    assert ranks[0] == "RuntimeError: no CUDA device"
    assert ranks[1] == ("EngineError: SGLang did not start on rank 0, this group's leader: "
                        "RuntimeError: no CUDA device")  # fmt: skip
