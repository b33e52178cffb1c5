"""`%%gputrain --export train.py`: the cell as a standalone script for torchrun.

The script holds what the cell needs from earlier cells (imports, functions, classes,
data), the cell itself, and the same `Trainer(TrainConfig(...)).fit(...)` call, then
rank 0 saves the trained weights next to the script:

    torchrun --standalone --nproc-per-node 2 train.py

Every rank runs the whole file; the Trainer joins the process group that torchrun
set up. What comes from earlier cells is found by name: for each name the cell uses
but does not define, the last statement of the notebook's history that binds it (an
import, a def, a class, an assignment), and recursively what that statement uses.
Names the history does not explain come from the user namespace (modules, importable
functions and classes, or `inspect.getsource` of the notebook's own). Statements that
only change an object (`model.eval()`, `x[0] = 1`) are not carried over.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import inspect
import textwrap
import types
import warnings
from pathlib import Path

from gpunb.config import TrainConfig
from gpunb.errors import GpunbError
from gpunb.runtime.roles import NAMES, REQUIRED

_BUILTINS = set(dir(builtins)) | {"__name__", "__file__", "get_ipython"}
_AFTER_ALL, _BEFORE_ALL = (float("inf"), 0), (-1, 0)  # positions (cell, statement) in the history
_HEADER = '''"""Training script exported by gpunb from a notebook cell: {magic}

Run it on this machine's GPUs (or CPU processes: see accelerator below):
    torchrun --standalone --nproc-per-node {devices} {name}
On several machines (the same command on each; HOST is the first machine):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 {name}
Or in one process (it starts the devices' processes itself): python {name}
Every %%gputrain option works on its command line too (`python {name} --epochs 5`; `--help` lists them).

Every rank runs the whole file; gpunb's Trainer joins the process group torchrun sets up.
The trained weights go to {weights} (written by rank 0).
"""
'''


def export_script(path, cell_source: str, config: TrainConfig, ipython=None, *,
                  names: dict | None = None, options_line: str = "") -> Path:
    """Write the training cell `cell_source` as a standalone script at `path`.

    `config` is the TrainConfig the magic built from its options (`options_line` is
    only quoted in the header); `ipython` (an InteractiveShell) gives the history and
    the user namespace; without it only the cell itself is used. `names` maps fit's
    roles (model, train_data, val_data, optimizer, loss_fn, step, metrics, callbacks)
    to the notebook's variable names when they differ (`--model net`). A role is passed
    to fit when the cell assigns its variable, or the namespace holds a value of the
    right kind there (so a stray `step = 5` is not taken for a step function).
    Returns the path.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError("export_script(path, cell_source, config, ipython, *, names=None, options_line='') "
                        f"takes the TrainConfig built from the options, got a {type(config).__name__}.")
    path = Path(path)
    cell_source = _body(cell_source)
    cell = _parse(cell_source, "the cell")
    namespace = dict(getattr(ipython, "user_ns", None) or {})
    bound = _bound(cell)
    variables = {role: (names or {}).get(role) or role for role in NAMES}
    roles = {role: name for role, name in variables.items()
             if name in bound or _fits(role, namespace.get(name))}
    for required in REQUIRED:
        if required not in roles:
            raise GpunbError(f"Cannot export: the cell defines no `{variables[required]}` and the "
                             "notebook has none.",
                             f"the training cell must assign `{variables[required]}` (or an earlier "
                             "cell must).")
    transforms, transform_names = _render_transforms(config, namespace)
    needed = (_free(cell) | set(roles.values()) | set(transform_names)) - bound
    statements = _Statements(_earlier_cells(ipython, cell_source))
    chosen, unresolved, from_namespace = statements.resolve(needed, namespace)
    weights = path.with_suffix(".weights.pt").name
    parts = [_HEADER.format(magic=f"%%gputrain {options_line}".strip(), devices=_devices(config),
                            name=path.name, weights=weights)]
    if unresolved:
        parts.append("# gpunb could not find where these names come from; define them here: "
                     + ", ".join(sorted(unresolved)) + "\n")
        warnings.warn(f"gpunb export: define {', '.join(sorted(unresolved))} in {path} before running it.",
                      RuntimeWarning, stacklevel=2)
    # Names only the namespace explains come first (imports, then definitions, those found
    # last first: they are what the earlier ones use), then the history's statements in order.
    from_namespace.reverse()
    from_namespace.sort(key=lambda source: not source.startswith(("import ", "from ")))
    earlier = from_namespace + statements.sources(chosen)
    if earlier:
        parts.append("# ---- from earlier cells\n" + _layout(earlier))
    parts.append("# ---- the training cell\n" + cell_source.strip() + "\n")
    parts.append(_training(config, roles, weights, transforms))
    path.write_text("\n\n".join(part.rstrip() + "\n" for part in parts).rstrip() + "\n")
    return path


def _layout(sources: list[str]) -> str:
    """Statements one per line; two blank lines around functions and classes (PEP 8)."""
    out = []
    for i, source in enumerate(sources):
        block = source.strip("\n").startswith(("def ", "class ", "@", "async def "))
        previous_block = i and sources[i - 1].strip("\n").startswith(("def ", "class ", "@", "async def "))
        if i and (block or previous_block):
            out.append("\n\n")
        out.append(source.strip("\n") + "\n")
    return "".join(out)


def _fits(name: str, value) -> bool:
    """Whether a namespace value looks like what fit takes as `name` (not a stray `step = 5`)."""
    if value is None:
        return False
    import torch

    if name == "optimizer":
        return isinstance(value, torch.optim.Optimizer)
    if name in ("loss_fn", "step"):
        return callable(value) and not isinstance(value, type)
    if name == "model":
        return isinstance(value, torch.nn.Module)
    if name == "callbacks":
        return isinstance(value, (list, tuple))
    return not isinstance(value, (int, float, str, bool, types.ModuleType))


def _training(config: TrainConfig, roles: dict, weights: str, transforms: str | None) -> str:
    options = _config_arguments(config, transforms)
    positional = [roles[r] for r in ("model", "train_data", "val_data") if r in roles]
    keywords = [f"{role}={name}" for role, name in roles.items()
                if role not in ("model", "train_data", "val_data")]
    call = ", ".join(positional + keywords)
    model = roles["model"]
    return f'''# ---- training (every rank runs it; a spawned helper process re-reading this file does not)
if __name__ == "__main__":
    import gc
    import os

    import sys

    import torch.distributed

    import gpunb
    import gpunb.distributed
    from gpunb.config_flags import parse_config

    gpunb_config = parse_config(sys.argv[1:], gpunb.TrainConfig({options}))  # `--epochs 5` overrides
    gpunb_result = gpunb.Trainer(gpunb_config).fit({call})
    # Every rank takes part (with FSDP the shards are gathered); rank 0 writes the file.
    gpunb.distributed.save_weights({model}, os.path.join(os.path.dirname(os.path.abspath(__file__)), {weights!r}))
    if int(os.environ.get("RANK", "0")) == 0:
        print(gpunb_result)
    if torch.distributed.is_initialized():
        # DDP's reducer sits in a reference cycle: free it before its process group goes,
        # or torch may abort at exit ("terminate called without an active exception").
        gc.collect()
        torch.distributed.destroy_process_group()
'''


def _config_arguments(config: TrainConfig, transforms: str | None) -> str:
    """The fields that differ from the defaults, as keyword arguments."""
    default = TrainConfig()
    out = []
    for f in dataclasses.fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name == "transforms":
            if value:
                out.append(f"transforms={transforms}")
            continue
        if value != getattr(default, f.name):
            out.append(f"{f.name}={value!r}")
    return ", ".join(out)


def _render_transforms(config: TrainConfig, namespace: dict):
    """The transforms as source text, and the names it uses (looked up like other names)."""
    if not config.transforms:
        return None, []
    names = []
    for transform in config.transforms:
        name = next((k for k, v in namespace.items() if v is transform and not k.startswith("_")), None)
        if name is None:
            return "()  # gpunb could not write the transforms out: set them here", []
        names.append(name)
    return "[" + ", ".join(names) + "]", names


def _devices(config: TrainConfig) -> str:
    return str(config.devices) if isinstance(config.devices, int) and config.devices > 1 else "N"


def _body(cell_source: str) -> str:
    """The cell without its `%%gputrain ...` line, if it still has it."""
    lines = cell_source.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        lines = lines[1:]
    return "\n".join(lines)


def _parse(source: str, what: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as error:
        raise GpunbError(f"Cannot export: {what} is not plain Python ({error.msg}, line {error.lineno}).",
                         "line magics and shell commands (`%...`, `!...`) cannot go into a script; "
                         "move them to another cell.") from error


def _earlier_cells(ipython, cell_source: str) -> list[str]:
    """The Python of the session's earlier cells, oldest first, magics left out."""
    history = getattr(getattr(ipython, "history_manager", None), "input_hist_raw", None) or []
    cells = []
    for raw in history:
        source = _python_of(raw)
        if source is not None and source.strip():
            cells.append(source)
    if cells and cells[-1].strip() == cell_source.strip():
        cells.pop()  # IPython stores the running cell before it runs
    return cells


def _python_of(raw: str) -> str | None:
    lines = raw.splitlines()
    if lines and lines[0].lstrip().startswith("%%"):
        if not lines[0].lstrip().startswith("%%gputrain"):
            return None  # another language or tool: %%bash, %%time of something else
        lines = lines[1:]
    source = "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
    try:
        ast.parse(source)
    except SyntaxError:
        return None
    return source


class _Statements:
    """The top-level statements of the earlier cells, with what each binds and uses."""

    def __init__(self, cells: list[str]):
        self.items = []  # (position, source, bound names, free names, node)
        for c, cell in enumerate(cells):
            for s, node in enumerate(ast.parse(cell).body):
                source = ast.get_source_segment(cell, node, padded=True) or ""
                self.items.append(((c, s), textwrap.dedent(source), _bound(node), _free(node), node))

    def resolve(self, names: set, namespace: dict):
        """(chosen statement positions, names nobody explains, sources taken from the namespace)."""
        chosen, unresolved, extra = set(), set(), []
        todo = [(name, _AFTER_ALL) for name in names]  # the cell comes after every earlier statement
        seen = set()
        while todo:
            name, before = todo.pop()
            if (name, before) in seen or name in _BUILTINS:
                continue
            seen.add((name, before))
            item = self._binding(name, before)
            if item is not None:
                if item[0] not in chosen:
                    chosen.add(item[0])
                    todo.extend((n, item[0]) for n in item[3])
            elif name in namespace and (source := _from_namespace(name, namespace)) is not None:
                if source not in extra:
                    extra.append(source)
                    tree = ast.parse(source)
                    todo.extend((n, _BEFORE_ALL) for n in _free(tree) - _bound(tree))
            else:
                unresolved.add(name)
            if not todo:  # calls that act on what was chosen, and the seeding before it
                for item in self._followers(chosen):
                    chosen.add(item[0])
                    todo.extend((n, item[0]) for n in item[3])
        return chosen, unresolved, extra

    def sources(self, positions: set) -> list[str]:
        return [item[1] for item in self.items if item[0] in positions]

    def _binding(self, name: str, before: tuple):
        for item in reversed(self.items):
            if item[0] < before and name in item[2]:
                return item
        return None

    def _followers(self, chosen: set) -> list:
        """Call statements to carry over too: `torch.manual_seed(0)` before a chosen statement
        of its cell (the data it seeds would differ otherwise), and `x.method(...)` after the
        chosen statement that binds x (`model.load_state_dict(...)`, `x.clamp_(0, 1)`)."""
        found = []
        for item in self.items:
            position, node = item[0], item[4]
            if position in chosen or not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
                continue
            function = node.value.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if "seed" in name.lower():
                if any(c[0] == position[0] and c > position for c in chosen):
                    found.append(item)
                continue
            root = function.value if isinstance(function, ast.Attribute) else None
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name):
                binding = self._binding(root.id, position)
                module = binding is not None and isinstance(binding[4], (ast.Import, ast.ImportFrom))
                if binding is not None and binding[0] in chosen and not module:  # not plt.show()
                    found.append(item)
        return found


def _from_namespace(name: str, namespace: dict) -> str | None:
    """Source that rebuilds `name` from the user namespace: an import, or a definition."""
    if name not in namespace:
        return None
    value = namespace[name]
    if isinstance(value, types.ModuleType):
        module = value.__name__
        return f"import {module}" if module == name else f"import {module} as {name}"
    if isinstance(value, (type, types.FunctionType)):
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
        if module and module != "__main__" and "<" not in qualname:
            alias = "" if qualname == name else f" as {name}"
            return f"from {module} import {qualname}{alias}"
        try:
            return textwrap.dedent(inspect.getsource(value))
        except (OSError, TypeError):
            return None
    return None


def _bound(node: ast.AST) -> set:
    """Names a statement (or a cell) binds at its top level."""
    names = set()
    for child in ([node] if not isinstance(node, ast.Module) else node.body):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in child.names if a.name != "*")
        else:
            for sub in ast.walk(child):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
                elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names if a.name != "*")
    return names


def _free(node: ast.AST) -> set:
    """Names a statement (or a cell) reads that it does not bind itself (roughly: it may
    over-report, which only carries an extra statement over, never drops a needed one)."""
    loaded, stored = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            (loaded if isinstance(sub.ctx, ast.Load) else stored).add(sub.id)
        elif isinstance(sub, ast.arg):
            stored.add(sub.arg)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            stored.update((a.asname or a.name).split(".")[0] for a in sub.names)
    # A name read before the statement binds it (x = x + 1) needs the earlier binding too.
    own = _bound(node) if not isinstance(node, ast.Module) else set()
    rebinding = {n for n in own if n in loaded and not isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    return (loaded - stored - _BUILTINS) | rebinding
