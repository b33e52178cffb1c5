"""Turn what the user passed as data into tensors or a Dataset/DataLoader.

Arrays that speak DLPack or the NumPy protocol (NumPy, CuPy, JAX, ...) are taken
zero-copy with `torch.from_dlpack` / `torch.from_numpy`, never through Python lists.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from gpunb.errors import GpunbError

_SUPPORTED = ("a torch Dataset, a DataLoader, a tensor, a tuple of tensors, a list of samples "
              "(`(x, y)` pairs or dicts), arrays that "
              "support DLPack or the NumPy protocol (NumPy, CuPy, JAX), or any object with "
              "`__len__` and `__getitem__` (e.g. a Hugging Face `datasets.Dataset`)")


class MapDataset(Dataset):
    """Any object with `__len__` and `__getitem__` (a Hugging Face `datasets.Dataset`, a plain
    class) seen as a torch map-style Dataset; its `__getitems__` (batched reads) is kept."""

    def __init__(self, source):
        self.source = source
        if hasattr(source, "__getitems__"):
            self.__getitems__ = source.__getitems__

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index):
        return self.source[index]

    def __getstate__(self):
        return {"source": self.source}  # the bound __getitems__ is rebuilt, not pickled

    def __setstate__(self, state):
        self.__init__(state["source"])


def _is_map_style(data) -> bool:
    """Indexable with a length, and not an array that as_tensor takes whole."""
    array_like = any(hasattr(data, name) for name in
                     ("to_numpy", "__dlpack__", "__array_interface__", "__array__"))
    return (hasattr(data, "__len__") and hasattr(data, "__getitem__") and not array_like
            and not isinstance(data, (str, bytes)))


def _refuse_python_lists(data, what: str) -> None:
    """Rows holding Python lists (a `datasets.Dataset` without the torch format) would be
    collated column-wise into lists of tensors, shapes silently transposed."""
    row = data[0] if len(data) else None
    values = row.values() if isinstance(row, dict) else row if isinstance(row, (list, tuple)) else ()
    lists = [v for v in values if isinstance(v, list)]
    if lists:
        fix = ("`{what} = {what}.with_format('torch')`" if hasattr(data, "with_format")
               else "make each sample's values tensors (e.g. `torch.tensor(values)`)" if isinstance(data, list)
               else "return tensors from `__getitem__` (e.g. `torch.tensor(row)`)").format(what=what)
        raise GpunbError(f"The rows of {what} hold Python lists, which gpunb cannot stack into "
                         "batches of tensors.", f"give it rows of tensors: {fix}.")


def as_tensor(array: Any, what: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return _from_numpy(array, what)
    if hasattr(array, "to_numpy") and not hasattr(array, "__dlpack__"):  # pandas DataFrame/Series, polars
        return _from_numpy(_table_values(array, what), what)
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array)
    if hasattr(array, "__array_interface__") or hasattr(array, "__array__"):
        return _from_numpy(np.asarray(array), what)
    raise GpunbError(f"{what} holds a {type(array).__name__}, which gpunb cannot batch.",
                     f"pass {_SUPPORTED}.")


def _from_numpy(array: np.ndarray, what: str) -> torch.Tensor:
    if array.dtype == object or array.dtype.kind in "USM":
        raise GpunbError(f"{what} holds a NumPy array of dtype {array.dtype}, which is not numeric.",
                         "convert it to numbers first, e.g. `x.astype('float32')`, or encode text "
                         "and categories as integers.")
    if not array.flags.writeable:
        array = array.copy()  # torch warns on (and may not write through) read-only memory
    return torch.from_numpy(array)


def _table_values(table, what: str) -> np.ndarray:
    """A pandas (or similar) table's values; gpunb never imports pandas: it asks `to_numpy`."""
    values = table.to_numpy()
    if values.dtype == object:
        dtypes = getattr(table, "dtypes", None)
        columns = ([str(name) for name, dtype in dtypes.items() if not _numeric(dtype)]
                   if hasattr(dtypes, "items") else [])
        which = f" (non-numeric columns: {', '.join(columns[:8])})" if columns else ""
        raise GpunbError(f"{what} is a {type(table).__name__} whose values are not all numbers{which}.",
                         "drop or encode those columns first (e.g. `pd.get_dummies(df)` or "
                         "`df[col].cat.codes`), then pass `df.to_numpy(dtype='float32')`.")
    return values


def _numeric(dtype) -> bool:
    try:
        return np.dtype(dtype).kind in "biuf"
    except TypeError:  # pandas' own dtypes (category, string, nullable)
        return False


def adapt_data(data: Any, what: str = "train_data") -> tuple[torch.Tensor, ...] | Dataset | DataLoader:
    """Tensors (a tuple, all with the same first dimension), or the Dataset/DataLoader as is."""
    if isinstance(data, (DataLoader, Dataset)):
        if isinstance(data, TensorDataset):
            return tuple(data.tensors)
        return data
    if isinstance(data, list) and data and isinstance(data[0], (tuple, dict)):
        # A list of samples, `[(x, y), ...]` or `[{"x": ..., "y": ...}, ...]`: batched by default
        # collation, as a plain DataLoader batches it. A tuple stays columns: `(x, y)`.
        _refuse_python_lists(data, what)
        return MapDataset(data)
    if isinstance(data, (list, tuple)):
        if not data:
            raise GpunbError(f"{what} is an empty {type(data).__name__}.", f"pass {_SUPPORTED}.")
        tensors = tuple(as_tensor(item, f"{what}[{i}]") for i, item in enumerate(data))
    elif isinstance(data, dict):
        raise GpunbError(f"{what} is a dict; gpunb batches positional tensors.",
                         "pass a tuple such as `(x, y)`, or a Dataset whose items are dicts.")
    elif _is_map_style(data):
        _refuse_python_lists(data, what)
        return MapDataset(data)
    else:
        tensors = (as_tensor(data, what),)
    lengths = {tuple(t.shape[:1]) for t in tensors}
    if any(t.ndim == 0 for t in tensors):
        raise GpunbError(f"{what} holds a 0-d tensor; each tensor needs a first (sample) dimension.")
    if len(lengths) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise GpunbError(f"The tensors in {what} disagree on the number of samples: {shapes}.",
                         "every tensor needs the same first dimension, e.g. x of shape (N, ...) "
                         "and y of shape (N,).")
    return tensors


def data_length(data) -> int | None:
    """Samples in the data, when it has a length."""
    if isinstance(data, tuple):
        return len(data[0])
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, IterableDataset):
        return None
    try:
        return len(data)
    except TypeError:
        return None


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (a dict's first tensor value),
    or the length of a list of plain values (a column of strings)."""
    if type(batch) is tuple and batch and type(batch[0]) is torch.Tensor and batch[0].ndim:
        return batch[0].shape[0]  # the common (inputs, target) batch, answered in one check per step
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, dict):
        values = list(batch.values())
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return batch_size_of(tensors[0] if tensors else values[0]) if values else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0]) if _nested(batch) else len(batch)
    return 1


def _nested(items) -> bool:
    """A list of tensors or containers (a batch's parts), not of plain per-sample values."""
    return isinstance(items[0], (torch.Tensor, dict, list, tuple))


def split_batch(batch: Any, parts: int) -> list:
    """`batch` cut into `parts` micro-batches along the sample dimension (views, no copy)."""
    if parts == 1:
        return [batch]
    size = batch_size_of(batch)
    step = -(-size // parts)
    return [slice_batch(batch, start, start + step) for start in range(0, size, step)]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples start:stop of every tensor, and of every list of plain values (strings), in `batch`."""
    if isinstance(batch, (list, tuple)) and batch and not _nested(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return map_tensors(batch, lambda t: t[start:stop])


def map_tensors(batch: Any, fn) -> Any:
    """`batch` with `fn` applied to every tensor in it (tensors, tuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def move_batch(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


def first_batch(data, size: int, device):
    """A batch like training's first (its first samples), on the device, drawn without a DataLoader
    iterator so that no worker starts and no sampler moves on."""
    if isinstance(data, tuple):
        return tuple(t[:size].to(device) for t in data)
    collate, dataset = default_collate, data
    if isinstance(data, DataLoader):
        collate, dataset = data.collate_fn, data.dataset
        if data.batch_sampler is None:  # the loader yields the dataset's items as batches
            size = None
        else:
            size = data.batch_size or getattr(data.batch_sampler, "batch_size", None) or 2
    if isinstance(dataset, IterableDataset):
        items = list(itertools.islice(iter(dataset), size or 1))
    else:
        items = [dataset[i] for i in range(min(size or 1, len(dataset)))]
    return move_batch(collate(items[0]) if size is None else collate(items), device)
