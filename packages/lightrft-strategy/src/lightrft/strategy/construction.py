"""How a strategy is constructed: upstream's constructor arguments, and a strategy that
is ready when the constructor returns.

Upstream LightRFT's ``StrategyBase.__init__`` calls ``setup_distributed()`` itself, so
``get_strategy(args)`` (and ``DeepspeedStrategy(...)``, ``FSDPV2Strategy(...)``,
``FakeStrategy(...)``) give a strategy that has joined the launched job. Ours does the
same, at the end of ``StrategyBase.__init__``, once its backend and engine link exist.
``defer_setup=True`` skips it; the caller then calls ``setup_distributed()`` before
anything that depends on the world.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from lightrft.config import StrategyConfig

#: Upstream's positional parameters of ``StrategyBase`` and ``FakeStrategy``.
BASE_PARAMETERS: tuple[str, ...] = (
    "seed",
    "max_norm",
    "micro_train_batch_size",
    "train_batch_size",
    "args",
)


class NotSetUpError(RuntimeError):
    """A strategy built with ``defer_setup=True`` was used before ``setup_distributed()``."""


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def config_from_constructor(
    owner: str,
    parameters: Sequence[str],
    positional: Sequence[Any],
    overrides: Mapping[str, Any],
) -> tuple[StrategyConfig, Any]:
    """The config and the original ``args`` object of a strategy constructor call.

    Two call shapes are accepted:

    * ours: ``Cls(config, **overrides)`` where ``config`` is a :class:`StrategyConfig`,
      an argparse namespace, a mapping or None;
    * upstream's: ``Cls(seed, max_norm, micro_train_batch_size, train_batch_size, ...,
      args)`` positionally or by keyword, ``parameters`` naming the positions. Values
      given this way win over ``args``; those not given come from ``args`` (or the
      config defaults). ``overrides`` win over everything.
    """
    fields = dict(overrides)
    args = fields.pop("args", None)
    if positional and not _is_number(positional[0]):
        if len(positional) > 1:
            raise TypeError(
                f"{owner}(config, ...) takes the config alone positionally; pass other "
                f"settings by keyword, or use upstream's order ({', '.join(parameters)})"
            )
        if args is not None:
            raise TypeError(f"{owner}: pass the configuration once (config or args=), not both")
        args = positional[0]
    else:
        if len(positional) > len(parameters):
            raise TypeError(
                f"{owner}() takes at most {len(parameters)} positional arguments "
                f"({', '.join(parameters)}), got {len(positional)}"
            )
        for name, value in zip(parameters, positional, strict=False):
            if name == "args":
                if args is not None:
                    raise TypeError(f"{owner}: args given twice")
                args = value
            elif name in fields:
                raise TypeError(f"{owner}: got multiple values for {name!r}")
            else:
                fields[name] = value
    # upstream's parameters left at None mean "not given": args (or the default) decides
    fields = {k: v for k, v in fields.items() if v is not None or k not in parameters}
    if isinstance(args, StrategyConfig) and not fields:
        return args, args
    return StrategyConfig.from_args(args, **fields), args
