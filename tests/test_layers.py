"""No module imports a layer above its own, and no import circle (docs/architecture.md draws the layers).

Every module under gpunb/ is parsed with `ast`; every import counts, also the ones
inside functions, which is where upward arrows and circles used to hide. The runtime's
rooms have layers of their own (RUNTIME_LAYERS), read along the flow of one step.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpunb"

# Bottom to top. A module may import its own layer and the ones below it.
LAYERS = [
    {"config", "config_flags", "errors", "charts", "units", "render", "quiet"},
    {"telemetry", "runs"},
    {"runtime"},
    {"distributed", "profiling", "loggers"},
    {"jobs"},  # a run as a job (submitit): ships through distributed, records in runs
    {"sweeps"},  # many trials of one fit, sampled and pruned by an Optuna study; handed its fit from above
    {"trainer"},  # the front door: one process, launched processes or a torchrun group
    {"notebook", "server"},  # the magics are a thin front-end over the front door
    {"__init__", "__main__", "cli", "demo"},  # the package's names and the commands
]
TOP = len(LAYERS) - 1

# Upward arrows that remain until the display code leaves the runtime: (importer, imported).
# This list only shrinks.
KNOWN = set()


# The runtime's own layers, bottom to top, by the name under gpunb.runtime (a room or a module).
RUNTIME_LAYERS = [
    {"events", "context", "device", "roles", "matching", "trainable", "run_state", "plan", "placement"},  # the words every room uses
    {"feed"},  # the user's data into batches on the device
    {"step"},  # one optimizer step
    {"validation"},  # scoring the weights on held-out data
    {"state"},  # checkpoints, resume, continue
    {"memory"},  # the measures under which a run fits (the summary's probe finds the blocks with it)
    {"setup"},  # what a run needs before its first batch (the probes build trial runs with it)
    {"probes"},  # what a run learns about itself before its first step
    {"epoch", "eta", "interrupt", "teardown", "result", "predict", "adapters", "prepare", "loop", "__init__"},  # on top
]


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
            for alias in node.names:  # `from gpunb.runtime import loop` imports gpunb.runtime.loop
                submodule = base.startswith("gpunb") and is_module(f"{base}.{alias.name}")
                found.add(f"{base}.{alias.name}" if submodule else base)
    return {name for name in found if name == "gpunb" or name.startswith("gpunb.")}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").exists()


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
    ("def f():\n    from gpunb.distributed import launch\n", ("gpunb.runtime.loop", "gpunb.distributed.launch")),
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


def import_graph() -> dict:
    """Each gpunb module and the gpunb modules it imports, lazy imports included."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = imported(tree, module, path.name == "__init__.py") - {module}
    return graph


def circles(graph: dict) -> list:
    """The import circles of `graph`: each a sorted list of the modules that reach one another."""
    found, reached, index, low, stack = [], {}, {}, {}, []

    def visit(module):  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        reached[module] = True
        for name in graph.get(module, ()):
            if name not in index:
                visit(name)
                low[module] = min(low[module], low[name])
            elif reached.get(name):
                low[module] = min(low[module], index[name])
        if low[module] == index[module]:
            component = []
            while True:
                name = stack.pop()
                reached[name] = False
                component.append(name)
                if name == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def runtime_layer_of(module: str) -> int:
    parts = module.split(".")
    name = parts[2] if len(parts) > 2 else "__init__"
    for level, names in enumerate(RUNTIME_LAYERS):
        if name in names:
            return level
    raise AssertionError(f"{module}: not in any runtime layer; place it in RUNTIME_LAYERS")


def test_no_import_circle_lazy_imports_included():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_a_circle_through_a_lazy_import_is_seen():
    lazy = "def f():\n    from gpunb.runtime.loop import run\n"
    graph = import_graph()
    graph["gpunb.runtime.feed.inputs"] |= imported(ast.parse(lazy), "gpunb.runtime.feed.inputs", False)
    assert any("gpunb.runtime.feed.inputs" in c and "gpunb.runtime.loop" in c for c in circles(graph))


def test_no_runtime_module_imports_a_room_above_its_own():
    arrows = sorted((module, name) for module, names in import_graph().items() if module.startswith("gpunb.runtime")
                    for name in names if name.startswith("gpunb.runtime.")
                    and runtime_layer_of(name) > runtime_layer_of(module))
    assert not arrows, "imports up the runtime's layers:\n" + "\n".join(f"  {a} -> {b}" for a, b in arrows)


def test_every_runtime_room_and_module_has_a_layer():
    for path in (PACKAGE / "runtime").iterdir():
        if path.suffix == ".py" or (path / "__init__.py").exists():
            assert any(path.stem in names for names in RUNTIME_LAYERS), f"runtime/{path.name}: place it in RUNTIME_LAYERS"


def test_a_submodule_imported_from_its_package_is_an_arrow_to_the_submodule():
    source = "from gpunb.runtime.state import checkpoint_files as ckpt\nfrom gpunb.runtime import device\n"
    assert imported(ast.parse(source), "gpunb.runtime.loop", False) == {
        "gpunb.runtime.state.checkpoint_files", "gpunb.runtime.device"}


def _class_names(tree) -> list[str]:
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_no_two_classes_in_the_package_share_a_name():
    """One name, one idea: a reader who meets `RunPlan` or `MemoryPlan` knows which it is."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in _class_names(ast.parse(path.read_text(), str(path))):
            where.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: files for name, files in where.items() if len(files) > 1}
    assert not shared, f"classes that share a name: {shared}"


def test_a_shared_class_name_is_seen():
    tree = ast.parse("class Plan:\n    pass\ndef f():\n    class Plan:\n        pass\n")
    assert _class_names(tree) == ["Plan", "Plan"]
