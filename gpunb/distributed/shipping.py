"""Sending fit's arguments to spawned processes, and saying clearly what cannot travel.

A spawned process starts from nothing: the model, the data, the optimizer and the
loss are pickled here and rebuilt there. cloudpickle carries classes and functions
of the notebook (`__main__`, or any module made at run time) by value, so a class
defined in an earlier cell works. Tensors on a GPU travel as CPU tensors (each rank
moves them to its own device), so the ranks never crowd onto this process's GPU.
The bytes travel down a pipe per rank, written by a thread of their own (`Couriers`),
never by the thread that starts the ranks and answers Ctrl-C.
"""

from __future__ import annotations

import io
import pickle
import re
import sys
import threading
import types
from dataclasses import field, fields, make_dataclass
from typing import Any

import cloudpickle
import torch

from gpunb.errors import GpunbError
from gpunb.runtime.roles import SETUP


# What each rank needs to run the same fit: the config, the set-up roles in their order, and the
# RunState class the run keeps its state in (None: the runtime's own).
FitArgs = make_dataclass("FitArgs", [("config", Any), *((name, Any, field(default=None)) for name in SETUP),
                                     ("state_type", Any, field(default=None))])
FitArgs.__module__ = __name__  # pickled by reference: a spawned rank imports it from here


def ship(args: FitArgs) -> bytes:
    """`args` as bytes (one pickle, so the optimizer keeps pointing at the model's parameters)."""
    sourceless = _sourceless_modules()
    for module in sourceless:
        cloudpickle.register_pickle_by_value(module)
    try:
        return _dumps(args)
    except Exception as error:
        raise _unshippable(args, error) from error
    finally:
        for module in sourceless:
            cloudpickle.unregister_pickle_by_value(module)


def unship(payload: bytes) -> FitArgs:
    try:
        return pickle.loads(payload)
    except Exception as error:
        raise GpunbError(f"A spawned process could not rebuild fit's arguments: "
                         f"{type(error).__name__}: {error}",
                         "objects from installed modules travel by name and are imported again in "
                         "the new process: check that the module imports there (same working "
                         "directory and sys.path), or define the class in the notebook.") from error


class Couriers:
    """The shipped arguments on their way to the spawned ranks: a pipe per rank, each written
    by a daemon thread.

    multiprocessing would write them into the pipe that starts each process, from the thread
    that starts it, while keeping that pipe's read end open itself: a rank that dies before
    reading them all (a Ctrl-C reaches the kernel's whole process group, which a rank still
    starting has not left yet) leaves that write blocked for good. Here the kernel's thread
    never writes, and once the ranks have started only they hold the read ends, so a dead
    rank breaks its pipe and its thread ends.
    """

    def __init__(self, payload: bytes, count: int, context):
        pipes = [context.Pipe(duplex=False) for _ in range(count)]
        self.readers = [reader for reader, _ in pipes]  # each rank gets all and keeps its own (`receive`)
        self._writers = [writer for _, writer in pipes]
        self._payload = payload
        self._threads: list[threading.Thread] = []

    def send(self) -> None:
        """Once the ranks have started (holding their copies of the read ends): send each its bytes."""
        for reader in self.readers:
            reader.close()
        for rank, writer in enumerate(self._writers):
            thread = threading.Thread(target=self._send, args=(writer,), name=f"gpunb-ship-{rank}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _send(self, writer) -> None:
        try:
            writer.send_bytes(self._payload)
        except OSError:
            pass  # the rank died before reading; the launcher reports how it ended
        finally:
            writer.close()

    def close(self, timeout: float) -> None:
        """After the ranks have ended (their pipes are then broken): wait for the threads."""
        for reader in self.readers:
            reader.close()
        for thread in self._threads:
            thread.join(timeout)
        if not self._threads:
            for writer in self._writers:
                writer.close()


def receive(readers: list, rank: int) -> FitArgs:
    """In a spawned rank: its arguments, from the pipe `Couriers` writes for it."""
    try:
        payload = readers[rank].recv_bytes()
    finally:
        for reader in readers:
            reader.close()
    return unship(payload)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            if isinstance(obj, torch.nn.Parameter):
                return torch.nn.Parameter, (obj.detach().cpu(), obj.requires_grad)
            return obj.detach().cpu().requires_grad_(obj.requires_grad).__reduce_ex__(self.proto)
        return super().reducer_override(obj)


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


MEASURED_OBJECTS = 100_000  # tensor_bytes looks at this many objects at most (a list of numbers is not data)


def tensor_bytes(value, depth: int = 8) -> int:
    """What the tensors and NumPy arrays inside `value` (containers, attributes, modules, a
    DataLoader's Dataset) weigh, each storage counted once, without pickling anything: pickling
    a tensor writes its whole storage, so this is a floor of the pickle's size."""
    seen: set = set()
    pending, total = [(value, depth)], 0
    while pending and len(seen) < MEASURED_OBJECTS:
        item, left = pending.pop()
        if item is None or isinstance(item, (str, bytes, int, float, bool)) or id(item) in seen:
            continue
        seen.add(id(item))
        total += _storage_bytes(item, seen)
        if left and not isinstance(item, (torch.Tensor, type, types.ModuleType)) and type(item).__module__ != "numpy":
            pending += [(child, left - 1) for child in _parts(item)]
    return total


def _storage_bytes(item, seen: set) -> int:
    """The bytes of a tensor's or array's storage the first time that storage is seen, else 0."""
    if isinstance(item, torch.Tensor):
        if item.device.type == "meta" or item.layout != torch.strided:
            return 0
        storage = item.untyped_storage()
        key = ("storage", item.device.type, storage.data_ptr())
        size = storage.nbytes()
    elif type(item).__module__ == "numpy" and hasattr(item, "nbytes"):
        return int(item.nbytes)  # an array (a view too) pickles its own elements, once per object
    else:
        return 0
    if key in seen:
        return 0
    seen.add(key)
    return size


def _parts(value) -> list:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    attributes = getattr(value, "__dict__", None)  # a Module's _parameters and _buffers are dicts in it
    return list(attributes.values()) if isinstance(attributes, dict) else []


def _sourceless_modules() -> list:
    """Modules made at run time (no file up their package chain): a new process cannot import
    them, so their classes and functions must travel by value, like the notebook's."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or not isinstance(module, types.ModuleType):
            continue
        root = sys.modules.get(name.partition(".")[0])
        if root is not None and not _has_origin(root) and not _has_origin(module):
            found.append(module)
    return found


def _has_origin(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(module, "__file__", None) or getattr(module, "__path__", None)
                or getattr(spec, "origin", None))


def unpicklable_part(args: FitArgs) -> tuple[str, str, str, Exception] | None:
    """(argument name, what: "a generator", where: " (at `path`)", error) of the first part of
    fit's arguments that does not pickle, or None."""
    for f in fields(FitArgs):
        value = getattr(args, f.name)
        if value is None:
            continue
        name = f.name if f.name != "config" else "config.transforms"
        value = value.transforms if f.name == "config" else value
        culprit = _find_unpicklable(value, name, depth=4)
        if culprit is None:
            continue
        path, inner, inner_error = culprit
        return name, _kind(inner, inner_error), "" if path == name else f" (at `{path}`)", inner_error
    return None


def _unshippable(args: FitArgs, error: Exception) -> GpunbError:
    """Which argument failed to pickle, what inside it, and what to do instead."""
    found = unpicklable_part(args)
    if found is not None:
        name, what, where, inner_error = found
        return GpunbError(
            f"`{name}` holds {what}{where} that cannot be pickled, so it cannot be sent to the "
            f"processes of the other devices ({type(inner_error).__name__}: {inner_error}).",
            "CUDA is already in use in this process, so gpunb starts the device processes with "
            "spawn, which sends fit's arguments by pickling them. Build "
            f"`{name}` from parts that pickle (tensors, a Dataset holding tensors or file paths, "
            "a DataLoader over such a Dataset; a generator can become a list or a Dataset), or "
            "start the multi-device training before anything in this kernel uses CUDA: the "
            "processes are then forked and nothing is pickled.")
    return GpunbError(f"fit's arguments cannot be pickled for the device processes: "
                      f"{type(error).__name__}: {error}",
                      "make the model, data, optimizer and loss picklable, or run the multi-device "
                      "training before anything in this kernel uses CUDA (then nothing is pickled).")


def _find_unpicklable(value, path: str, depth: int):
    """(path, object, error) of the innermost part of `value` that does not pickle, or None."""
    try:
        _dumps(value)
        return None
    except Exception as error:  # pickling fails with any type (TypeError, PicklingError, ...)
        found = (path, value, error)
    if depth == 0:
        return found
    for child_path, child in _children(value, path):
        inner = _find_unpicklable(child, child_path, depth - 1)
        if inner is not None:
            return inner
    return found


def _children(value, path: str):
    if isinstance(value, dict):
        return [(f"{path}[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, torch.nn.Module):
        return [(f"{path}.{name}", item) for name, item in vars(value).items()
                if not name.startswith("_")] + [(f"{path}.{name}", m) for name, m in value.named_children()]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return [(f"{path}.{name}", item) for name, item in attributes.items()]
    return []


def _kind(value, error: Exception) -> str:
    """'a generator', 'a lambda', 'a lock' ... for the message."""
    if isinstance(value, types.GeneratorType):
        return "a generator"
    match = re.search(r"pickle '([^']+)' object", str(error))
    name = match.group(1) if match else type(value).__name__
    if name.startswith("_thread."):
        name = name.removeprefix("_thread.")
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}"
