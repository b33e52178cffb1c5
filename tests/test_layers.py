"""No module imports a layer above its own (docs/architecture.md draws the layers).

Every module under gpunb/ is parsed with `ast`; every import counts, also the ones
inside functions, which is where upward arrows used to hide.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"

# Bottom to top. A module may import its own layer and the ones below it.
LAYERS = [
    {"config", "errors", "charts", "units", "render"},
    {"telemetry", "runs"},
    {"runtime"},
    {"distributed", "profiling", "loggers"},
    {"jobs"},  # a run as a job (submitit): ships through distributed, records in runs
    {"trainer"},  # the front door: one process, launched processes or a torchrun group
    {"notebook", "server"},  # the magics are a thin front-end over the front door
    {"__init__", "__main__", "cli", "demo"},  # the package's names and the commands
]
TOP = len(LAYERS) - 1

# Upward arrows that remain until the display code leaves the runtime: (importer, imported).
# This list only shrinks.
KNOWN = set()


def layer_of(module: str) -> int:
    """The layer of a dotted module name inside gpunb (`gpunb` itself is the top)."""
    parts = module.split(".")
    if len(parts) == 1:
        return TOP
    for level, names in enumerate(LAYERS):
        if parts[1] in names:
            return level
    raise AssertionError(f"{module}: not in any layer; place it in LAYERS (and in docs/architecture.md)")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, module: str, is_package: bool) -> set:
    """Every gpunb module `tree` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base != "gpunb":
                found.add(base)
                continue
            for alias in node.names:  # `from gpunb import runtime` imports gpunb.runtime, not gpunb
                submodule = (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").exists()
                found.add(f"gpunb.{alias.name}" if submodule else "gpunb")
    return {name for name in found if name == "gpunb" or name.startswith("gpunb.")}


def upward_imports() -> set:
    arrows = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        own = TOP if path.parent == PACKAGE and path.stem in LAYERS[TOP] else layer_of(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for name in imported(tree, module, path.name == "__init__.py"):
            if name == "gpunb" and own == TOP:
                continue
            if layer_of(name) > own:
                arrows.add((module, name))
    return arrows


def test_no_module_imports_a_layer_above_its_own():
    unexpected = upward_imports() - KNOWN
    assert not unexpected, "imports up the layers:\n" + "\n".join(f"  {a} -> {b}" for a, b in sorted(unexpected))


def test_the_known_exceptions_are_still_there():
    """An exception fixed is taken off KNOWN, so that it cannot come back unseen."""
    assert not KNOWN - upward_imports()


@pytest.mark.parametrize("source, arrow", [
    ("def f():\n    from gpunb.distributed import launch\n", ("gpunb.runtime.loop", "gpunb.distributed")),
    ("import gpunb.notebook.magics\n", ("gpunb.runtime.loop", "gpunb.notebook.magics")),
    ("from gpunb import Trainer\n", ("gpunb.runtime.loop", "gpunb")),
    ("from gpunb import trainer\n", ("gpunb.runtime.loop", "gpunb.trainer")),
    ("from .. import notebook\n", ("gpunb.runtime.loop", "gpunb.notebook")),
])
def test_an_upward_import_is_seen_even_inside_a_function(source, arrow):
    module, name = arrow
    assert name in imported(ast.parse(source), module, is_package=False)
    assert layer_of(name) > layer_of(module)


def test_every_top_level_module_and_package_has_a_layer():
    for path in PACKAGE.iterdir():
        if path.suffix == ".py" or (path / "__init__.py").exists():
            assert any(path.stem in names for names in LAYERS), f"{path.name}: place it in LAYERS"
