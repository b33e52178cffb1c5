"""DataLoader workers that start under any start method, with data defined in a notebook.

Under fork a worker inherits the dataset. Under spawn (macOS, Windows) and forkserver
(Linux from Python 3.14) the dataset, collate_fn and worker_init_fn are pickled to each
worker; a class or function of the notebook (`__main__`) pickles by reference, and the
worker, whose `__main__` is another module, cannot find it. Such objects travel by
value with cloudpickle instead (as the notebook's classes do to spawned ranks). What
cloudpickle cannot carry either is loaded in this process (0 workers), with one warning
that says why.
"""

from __future__ import annotations

import io
import multiprocessing
import pickle
import types
import warnings

import torch
from torch.utils.data import Dataset, IterableDataset

SHIPPED = ("dataset", "collate_fn", "worker_init_fn")  # what a worker receives by pickle


def start_method(context=None) -> str:
    """How workers start: the loader's own context, else this process's default."""
    if context is not None:
        return context if isinstance(context, str) else context.get_start_method()
    # get_start_method() without allow_none would fix the default for the whole process
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def for_workers(objects: dict, num_workers: int, context=None) -> tuple[dict, int, str | None]:
    """`objects` (dataset, collate_fn, worker_init_fn) made to reach workers started by `context`.

    Returns the objects (wrapped where they travel by value), the number of workers
    (0 when they cannot travel at all) and the start method when it had to be named.
    """
    if not num_workers:
        return objects, num_workers, None
    method = start_method(context)
    if method == "fork":  # workers inherit everything: nothing travels by pickle
        return objects, num_workers, None
    stuck = [name for name in SHIPPED if objects.get(name) is not None
             and not _pickles_by_reference(objects[name])]
    if not stuck:
        return objects, num_workers, None
    import cloudpickle

    shipped = dict(objects)
    try:
        for name in stuck:
            shipped[name] = _by_value(objects[name], cloudpickle.dumps(objects[name]))
    except Exception as error:  # noqa: BLE001 - anything cloudpickle refuses means: no workers
        warnings.warn(
            f"DataLoader workers start with {method!r}, which sends the {', '.join(stuck)} to each "
            f"worker by pickling, and it cannot be pickled ({type(error).__name__}: {error}); "
            "loading in this process instead (num_workers=0). To use workers, keep the dataset free "
            "of open files, locks and generators (open them in `__getitem__`), or move its class "
            "to a .py module and import it.", UserWarning, stacklevel=3)
        return objects, 0, None
    return shipped, num_workers, method


class _Finder(pickle.Pickler):
    """Pickles to nowhere, and stops at the first class or function that lives in `__main__`."""

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in __main__")
        if isinstance(obj, torch.Tensor) or type(obj).__name__ == "ndarray":
            return tuple, ()  # their bytes travel either way: no need to copy them to find out
        return NotImplemented


class _Nowhere(io.RawIOBase):
    def write(self, data) -> int:
        return len(data)


def _pickles_by_reference(obj) -> bool:
    """Whether plain pickle carries `obj` to a worker that imports only installed modules."""
    try:
        _Finder(_Nowhere(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception:  # noqa: BLE001 - a lambda, a local class, a __main__ class: by value then
        return False
    return True


def _by_value(obj, payload: bytes):
    if isinstance(obj, IterableDataset):
        return _ShippedIterable(obj, payload)
    if isinstance(obj, Dataset) or hasattr(obj, "__getitem__"):
        return _ShippedDataset(obj, payload)
    return _ShippedFunction(obj, payload)


def _unpickled(payload: bytes):
    return pickle.loads(payload)  # cloudpickle's output is ordinary pickle data


class _Shipped:
    """Stands for `obj` in this process; a worker unpickles `obj` itself, rebuilt by value."""

    def __init__(self, obj, payload: bytes):
        self.obj, self.payload = obj, payload

    def __reduce__(self):
        return _unpickled, (self.payload,)


class _ShippedDataset(_Shipped, Dataset):
    def __init__(self, obj, payload: bytes):
        super().__init__(obj, payload)
        if hasattr(obj, "__getitems__"):
            self.__getitems__ = obj.__getitems__  # batched reads, for a main-process read too

    def __len__(self) -> int:
        return len(self.obj)

    def __getitem__(self, index):
        return self.obj[index]


class _ShippedIterable(_Shipped, IterableDataset):
    def __iter__(self):
        return iter(self.obj)

    def __len__(self) -> int:
        return len(self.obj)


class _ShippedFunction(_Shipped):
    def __call__(self, *args, **kwargs):
        return self.obj(*args, **kwargs)
