"""What the installed SGLang offers the adapter, found out instead of assumed.

SGLang moves names between releases (``LocalSerializedTensor`` left
``sglang.srt.model_executor.model_runner`` for
``...model_runner_components.weight_updater``; upstream LightRFT's import of the old
path fails on 0.5.23), added a flattened-bucket weight format, and now refuses weight
updates outside a ``begin_weight_update()`` / ``end_weight_update()`` session.
:func:`load_api` imports every name from the first place it exists, records which
optional features are there, and binds every call the adapter makes (the keyword
arguments it passes, listed in :data:`CALLS`) to the installed function's real
signature, so a release whose API no longer fits fails at construction with an
:class:`SGLangAPIError` naming the version found, the supported range and the call,
instead of in the middle of a run. :meth:`SGLangAPI.call` binds again on every call.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightrft.engines.protocol import EngineError

SUPPORTED = (">=0.5.23", "<0.6")
"""The SGLang releases the adapter accepts (the API it binds to was checked on 0.5.23)."""

#: Where each name has lived, newest first: "module:attribute".
LOCATIONS: dict[str, tuple[str, ...]] = {
    "Engine": ("sglang.srt.entrypoints.engine:Engine", "sglang:Engine"),
    "ServerArgs": ("sglang.srt.server_args:ServerArgs",),
    "SamplingParams": ("sglang.srt.sampling.sampling_params:SamplingParams",),
    "MultiprocessingSerializer": ("sglang.srt.utils:MultiprocessingSerializer",),
    "LocalSerializedTensor": (
        "sglang.srt.model_executor.model_runner_components.weight_updater:LocalSerializedTensor",
        "sglang.srt.model_executor.model_runner:LocalSerializedTensor",
    ),
}
#: Optional: the flattened-bucket weight format with one payload per TP rank.
OPTIONAL: dict[str, tuple[str, ...]] = {
    "FlattenedTensorBucket": ("sglang.srt.weight_sync.tensor_bucket:FlattenedTensorBucket",),
    "normalize_payloads": ("sglang.srt.utils:normalize_serialized_named_tensor_payloads",),
}

#: Every call the adapter makes: (object, method ("" for the constructor), the keyword
#: arguments it passes). ``Engine()`` takes ``ServerArgs`` fields.
CALLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "ServerArgs",
        "",
        (
            "model_path",
            "tp_size",
            "base_gpu_id",
            "gpu_id_step",
            "dtype",
            "mem_fraction_static",
            "random_seed",
            "context_length",
            "skip_tokenizer_init",
            "enable_memory_saver",
            "trust_remote_code",
            "port",
            "log_level",
            "enable_lora",
            "max_lora_rank",
            "lora_target_modules",
        ),
    ),
    (
        "Engine",
        "generate",
        ("input_ids", "sampling_params", "return_logprob", "image_data", "video_data", "lora_path"),
    ),
    ("Engine", "load_lora_adapter_from_tensors", ("lora_name", "tensors", "config_dict")),
    ("Engine", "unload_lora_adapter", ("lora_name",)),
    ("Engine", "update_weights_from_tensor", ("named_tensors", "load_format", "flush_cache")),
    ("Engine", "release_memory_occupation", ("tags",)),
    ("Engine", "resume_memory_occupation", ("tags",)),
    ("Engine", "flush_cache", ()),
    ("Engine", "shutdown", ()),
    (
        "SamplingParams",
        "",
        ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed"),
    ),
    ("MultiprocessingSerializer", "serialize", ("obj",)),
    ("LocalSerializedTensor", "", ("values",)),
)
#: Called when the installed Engine has them (a weight-update session).
SESSION_CALLS = (("Engine", "begin_weight_update", ()), ("Engine", "end_weight_update", ()))
FLATTENED_CALLS = (("FlattenedTensorBucket", "", ("named_tensors",)),)


class SGLangAPIError(EngineError):
    """The installed SGLang does not offer what the adapter calls."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"0.5.23.post1"`` -> ``(0, 5, 23)``."""
    parts = []
    for piece in version.split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() < len(piece):
            break
    return tuple(parts)


def in_supported_range(version: str, supported: Sequence[str] = SUPPORTED) -> bool:
    found = version_tuple(version)
    for bound in supported:
        op, number = re.match(r"(>=|<)(.+)", bound).groups()  # type: ignore[union-attr]
        limit = version_tuple(number)
        if (op == ">=" and found < limit) or (op == "<" and found >= limit):
            return False
    return True


def _import(candidates: Sequence[str]) -> Any | None:
    for target in candidates:
        module, _, attribute = target.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError):
            continue
    return None


def _callable_of(obj: Any, method: str) -> Callable[..., Any]:
    if not method:
        return obj  # type: ignore[no-any-return]
    return getattr(obj, method)  # type: ignore[no-any-return]


@dataclass
class SGLangAPI:
    """The installed SGLang's names and features (build it with :func:`load_api`)."""

    version: str
    names: Mapping[str, Any]
    weight_update_session: bool
    flattened_bucket: bool
    _signatures: dict[tuple[Any, str], tuple[inspect.Signature, tuple[None, ...]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __getitem__(self, name: str) -> Any:
        return self.names[name]

    def describe(self) -> str:
        return f"SGLang {self.version} (supported: {','.join(SUPPORTED)})"

    def check_call(self, owner: str, method: str, kwargs: Mapping[str, Any]) -> None:
        """Bind ``kwargs`` to the installed ``owner.method``'s signature; a mismatch
        raises :class:`SGLangAPIError` naming the version, the range and the call."""
        target = self.names[owner]
        where = f"{owner}.{method}" if method else f"{owner}(...)"
        signature, args = self._signature(target, method, where)
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SGLangAPIError(
                f"{self.describe()}: {where}{signature} does not take the adapter's "
                f"arguments ({', '.join(kwargs) or 'none'}): {exc}. Install a supported "
                "SGLang release"
            ) from None

    def _signature(
        self, target: Any, method: str, where: str
    ) -> tuple[inspect.Signature, tuple[None, ...]]:
        """``target.method``'s signature and the placeholder for ``self`` it needs, read
        once per target (calls in a weight sync and per request bind many times)."""
        key = (target, method)
        if key not in self._signatures:
            try:
                signature = inspect.signature(_callable_of(target, method))
            except (AttributeError, TypeError, ValueError) as exc:
                raise SGLangAPIError(
                    f"{self.describe()} has no usable {where} ({exc}): the adapter calls it"
                ) from None
            params = list(signature.parameters.values())
            plain = bool(method) and isinstance(target, type) and _is_plain_method(target, method)
            args = (None,) if plain and params and params[0].name == "self" else ()
            self._signatures[key] = (signature, args)
        return self._signatures[key]

    def call(self, obj: Any, owner: str, method: str, /, **kwargs: Any) -> Any:
        """``obj.method(**kwargs)`` (``obj(**kwargs)`` for ``method=""``) after
        :meth:`check_call`."""
        self.check_call(owner, method, kwargs)
        return _callable_of(obj, method)(**kwargs)


def _is_plain_method(cls: type, method: str) -> bool:
    raw = inspect.getattr_static(cls, method, None)
    return not isinstance(raw, staticmethod | classmethod)


def load_api(version: str | None = None) -> SGLangAPI:
    """Import the installed SGLang's names and check every call in :data:`CALLS`.

    Raises:
        ImportError: SGLang is not installed (the message says what to install).
        SGLangAPIError: the version is outside :data:`SUPPORTED`, a name is in none of
            its known places, or a call does not bind.
    """
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(
            "engine_type='sglang' needs SGLang: pip install 'lightrft-engines[sglang]' "
            f"(supported: sglang{','.join(SUPPORTED)})"
        ) from exc
    found = version or str(getattr(sglang, "__version__", "0"))
    if not in_supported_range(found):
        raise SGLangAPIError(
            f"SGLang {found} is installed; the adapter supports sglang{','.join(SUPPORTED)}: "
            f"pip install 'sglang{','.join(SUPPORTED)}'"
        )
    names: dict[str, Any] = {}
    for name, candidates in LOCATIONS.items():
        value = _import(candidates)
        if value is None:
            raise SGLangAPIError(
                f"SGLang {found} (supported: {','.join(SUPPORTED)}) has no {name} in any "
                f"place the adapter knows: {', '.join(candidates)}"
            )
        names[name] = value
    for name, candidates in OPTIONAL.items():
        value = _import(candidates)
        if value is not None:
            names[name] = value
    engine = names["Engine"]
    session = callable(getattr(engine, "begin_weight_update", None)) and callable(
        getattr(engine, "end_weight_update", None)
    )
    flattened = "FlattenedTensorBucket" in names and "normalize_payloads" in names
    api = SGLangAPI(found, names, weight_update_session=session, flattened_bucket=flattened)
    calls = [*CALLS, *(SESSION_CALLS if session else ()), *(FLATTENED_CALLS if flattened else ())]
    for owner, method, kwargs in calls:
        api.check_call(owner, method, dict.fromkeys(kwargs))
    return api
