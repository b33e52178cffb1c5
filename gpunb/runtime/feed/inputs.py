"""Turn what the user passed as data into tensors or a Dataset/DataLoader.

Arrays that speak DLPack or the NumPy protocol (NumPy, CuPy, JAX, ...) are taken
zero-copy with `torch.from_dlpack` / `torch.from_numpy`, never through Python lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
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
    values = row.values() if is_mapping(row) else row if isinstance(row, (list, tuple)) else ()
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
    elif is_mapping(data):
        raise GpunbError(f"{what} is a {type(data).__name__}; gpunb batches positional tensors.",
                         "pass a tuple such as `(x, y)`, or a Dataset whose items are dicts (e.g. "
                         "`datasets.Dataset.from_dict(...).with_format('torch')`).")
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


def is_mapping(batch) -> bool:
    """Whether `batch` holds named parts: a dict, or any other Mapping, such as the
    `BatchEncoding` (a `UserDict`, not a dict) that Hugging Face tokenizers and collators return."""
    return isinstance(batch, Mapping)


def with_values(batch: Mapping, values: dict) -> Mapping:
    """`values` in a mapping of `batch`'s own type where one can be built from a dict (a dict,
    a `BatchEncoding`), else in a dict: a step that reads `batch.input_ids` keeps working."""
    if type(batch) is dict:
        return values
    try:
        return type(batch)(values)
    except (TypeError, ValueError):  # a Mapping that is not built from a dict (defaultdict, ...)
        return values


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its target (the last part of a tuple or list,
    as `loss_fn` reads it; a mapping's "labels"), else of its first tensor; the length of a list
    of plain values (a column of strings). The target, because the inputs need not have one row
    per sample: an EmbeddingBag's `(flat_tokens, offsets, labels)`. `TrainConfig.batch_size_fn`
    says it where neither tells."""
    if type(batch) is tuple and batch and type(batch[-1]) is torch.Tensor and batch[-1].ndim:
        return batch[-1].shape[0]  # the common (inputs, target) batch, answered in one check per step
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if is_mapping(batch):
        values = [batch[key] for key in ("labels", "label") if key in batch] + list(batch.values())
        tensors = [v for v in values if isinstance(v, torch.Tensor) and v.ndim]
        size = _part_size(tensors[0] if tensors else values[0]) if values else None
        return 1 if size is None else size
    if isinstance(batch, (list, tuple)) and batch:
        if not _nested(batch):
            return len(batch)
        size = _part_size(batch[-1])
        return size if size is not None else batch_size_of(batch[0])
    return 1


def _part_size(part) -> int | None:
    """Samples in one part of a batch; None for a part that does not say (a 0-d tensor)."""
    if isinstance(part, torch.Tensor):
        return part.shape[0] if part.ndim else None
    if isinstance(part, list) and part and is_mapping(part[0]):
        return len(part)  # one record per sample, e.g. a detection model's target dicts
    return batch_size_of(part) if isinstance(part, (list, tuple)) or is_mapping(part) else None


def _nested(items) -> bool:
    """A list of tensors or containers (a batch's parts), not of plain per-sample values."""
    return isinstance(items[0], (torch.Tensor, list, tuple, Mapping))


def split_batch(batch: Any, parts: int, size: int | None = None) -> list:
    """`batch` cut into `parts` micro-batches along the sample dimension (views, no copy).
    `size`: the samples in it, where the caller counts them its own way (batch_size_fn)."""
    if parts == 1:
        return [batch]
    size = batch_size_of(batch) if size is None else size
    check_sliceable(batch, size)
    step = -(-size // parts)
    return [slice_batch(batch, start, start + step) for start in range(0, size, step)]


def check_sliceable(batch: Any, size: int) -> None:
    """Refuses a batch whose tensors do not all hold one row per sample: cutting each at the same
    rows would pair the wrong rows (an EmbeddingBag's flat tokens and its labels)."""
    shapes = [tuple(t.shape) for t in batch_tensors(batch)]
    if any(not shape or shape[0] != size for shape in shapes):
        raise GpunbError(f"gpunb had to cut a batch of {size} samples into smaller pieces (to fit in "
                         "memory, or to drop the samples a rank repeats), and its tensors do not all "
                         f"hold one row per sample (shapes {', '.join(map(str, shapes))}), so the rows "
                         "of a piece would not belong together.",
                         "use a smaller `batch_size` (and `grad_accum` to keep the effective batch), "
                         "or give every tensor of a batch one row per sample.")


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples start:stop of every tensor, and of every list of plain values (strings), in `batch`."""
    if isinstance(batch, (list, tuple)) and batch and not _nested(batch):
        return batch[start:stop]
    if is_mapping(batch):
        return with_values(batch, {k: slice_batch(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, stop) for v in batch)
    return map_tensors(batch, lambda t: t[start:stop])


def map_tensors(batch: Any, fn) -> Any:
    """`batch` with `fn` applied to every tensor in it (tensors, tuples, lists, mappings; a mapping
    keeps its type where it can: with_values)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if is_mapping(batch):
        return with_values(batch, {k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def move_batch(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if is_mapping(batch):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


def gather_rows(tensors: tuple, rows: torch.Tensor) -> tuple:
    """Rows `rows` of each tensor: one gather each, into new contiguous memory. `index_select`
    rather than the `t[rows]` of a hand-written loop: the same rows, without advanced indexing's
    general machinery (several times faster on small batches; benchmarks/RESULTS.md)."""
    return tuple([t.index_select(0, rows) for t in tensors])


def loader_batch_size(loader: DataLoader) -> int | None:
    """The samples a DataLoader batches together: its batch_size, or its batch sampler's (None: unknown)."""
    return loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)


def first_batch(data, size: int, device):
    """A batch like training's first (its first samples), on the device, drawn without a DataLoader
    iterator so that no worker starts and no sampler moves on. It is made as the feeds make theirs
    (feeds.py): tensors gathered by `gather_rows` (contiguous, as training's; a slice of a slice
    such as `tokens[:, 1:]` is not), rows read with the dataset's `__getitems__` where it has
    one and put together by the loader's collate_fn, as a DataLoader's fetcher does."""
    if isinstance(data, tuple):  # the rows' index where the tensors are (they may be on the GPU already)
        rows = torch.arange(min(size, len(data[0])), device=data[0].device)
        return move_batch(gather_rows(data, rows), device)
    collate, dataset = default_collate, data
    if isinstance(data, DataLoader):
        collate, dataset = data.collate_fn, data.dataset
        if data.batch_sampler is None:  # the loader yields the dataset's items as batches
            size = None
        else:
            size = loader_batch_size(data) or 2
    if isinstance(dataset, IterableDataset):
        items = list(itertools.islice(iter(dataset), size or 1))
    elif size is not None and hasattr(dataset, "__getitems__"):
        items = dataset.__getitems__(list(range(min(size, len(dataset)))))
    else:
        items = [dataset[i] for i in range(min(size or 1, len(dataset)))]
    return move_batch(collate(items[0]) if size is None else collate(items), device)
