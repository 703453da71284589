"""Upstream LightRFT's actor wrapper: a module whose Hugging Face model is ``.model``.

Upstream's actors (``lightrft.models.ActorLanguage``, ``ActorVL``...) hold the causal LM
in ``actor.model`` and add the RL forward (log-probabilities of actions) around it.
Upstream's strategies treat such a module specially wherever a model is passed: they
wrap, train, checkpoint, sync and export ``actor.model``, and put the wrapped model back
into ``actor.model``. The strategy does the same: :func:`training_module` is the module
a backend wraps and trains for any model a caller passes, and
:func:`~lightrft.strategy.StrategyBase.prepare` of an actor returns the actor with its
``.model`` prepared.

A module is an actor when it is not itself a Hugging Face model (whose own ``.model``
is its backbone) and either says so (``is_actor = True``, which upstream's
``prepare_models_and_optimizers`` sets and this package's sets too) or has the
wrapper's shape: every one of its parameters belongs to its ``.model``, a Hugging Face
model (an unflagged EMA copy of an actor is recognised this way).
"""

from __future__ import annotations

from torch import nn


def _is_hf_model(module: object) -> bool:
    return isinstance(module, nn.Module) and callable(getattr(module, "save_pretrained", None))


def is_actor(model: object) -> bool:
    """Whether ``model`` is upstream's actor wrapper (upstream's ``is_actor``, which reads
    the flag only; here also the wrapper's shape, see the module docstring)."""
    if not isinstance(model, nn.Module):
        return False
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return False
    if _is_hf_model(model):  # a causal LM's own .model is its backbone, not an actor's
        return False
    if getattr(model, "is_actor", False):
        return True
    if not _is_hf_model(_unwrapped(inner)):
        return False
    return all(name.startswith("model.") for name, _ in model.named_parameters())


def _unwrapped(module: nn.Module) -> nn.Module:
    inner = getattr(module, "module", None)
    while isinstance(inner, nn.Module):
        module, inner = inner, getattr(inner, "module", None)
    return module


def training_module(model: nn.Module) -> nn.Module:
    """The module a backend wraps, trains and saves for ``model``: an actor wrapper's
    ``.model`` (prepared or not), else ``model`` itself."""
    return model.model if is_actor(model) else model  # type: ignore[return-value]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper (``.module`` chains); for upstream's actor
    wrapper, the Hugging Face model in its ``.model``, as upstream's DeepSpeed strategy
    ``unwrap_model`` does."""
    return _unwrapped(training_module(model))
