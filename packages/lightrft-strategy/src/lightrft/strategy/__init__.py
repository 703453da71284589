"""lightrft.strategy: placeholder until its issue lands (see the package README)."""

from importlib.metadata import version as _version

__version__ = _version("lightrft-strategy")

__all__ = ["__version__"]
