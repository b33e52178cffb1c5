"""A user's own DataLoader resumed part-way through an epoch, exactly.

A DataLoader draws an epoch's randomness when its iterator is made and first read: the
workers' base seed (from its generator, else torch's global RNG) and the sampler's order (a
RandomSampler draws a seed from torch's global RNG, or reads its generator). A resumed run
restores the RNGs as they were at the stop, mid-epoch; an iterator made then would draw the
epoch's order from the wrong state, and shift the RNG that Dropout draws from. So each epoch
notes the states its iterator was made from (the global RNGs and every generator the loader
and its sampler hold); a resumed epoch makes its iterator from them, reads past the batches
already used (the skipped ones are loaded: correctness over speed), then puts the stop's
global RNG states back. A torchdata StatefulDataLoader resumes through its own state_dict.
"""

from __future__ import annotations

import collections
import random
import warnings
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from gpunb.runtime import device as devices

_CPU = torch.device("cpu")
_AHEAD = 4  # a StatefulDataLoader's states kept: the step's position and the batches read ahead of it
_OWN_RNGS = (random.Random, np.random.Generator, np.random.RandomState)  # states gpunb cannot see


class EpochStart:
    """The RNG states a user's DataLoader made its epoch's iterator from; carried by RunState
    (`data_start`), so that a checkpoint written mid-epoch holds them."""

    def __init__(self, loader):
        self.loader = loader
        self.stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None))  # torchdata's StatefulDataLoader
        self.noted: dict | None = None  # this epoch's start, as state_dict() gives it
        self.pending: dict | None = None  # loaded from a checkpoint, used by the next epoch()
        self.recent = collections.deque(maxlen=_AHEAD)  # StatefulDataLoader: (position, its state)

    def batches(self, epoch: int, skip: int) -> Iterator:
        """The epoch's batches after the first `skip`, as the run that wrote the checkpoint saw them."""
        saved, self.pending = self.pending, None
        if self.stateful:
            return self._stateful(saved, epoch, skip)
        start = saved if saved is not None and saved.get("epoch") == epoch and skip else None
        if start is None:  # a new epoch (or a checkpoint without its start: read past, as before)
            if saved is not None and skip == 0 and saved.get("resets_next"):
                self._make_iterator_aside()  # persistent workers: the next epoch resets their iterator
            return self._skipped(self._begin(epoch), skip)
        stop = devices.rng_state(_CPU)  # set by the resume: the states at the stop
        devices.set_rng_state(start["rng"], _CPU)
        for generator, state in zip(self._generators(), start["generators"]):
            generator.set_state(state)
        if not start["made"]:
            self._make_iterator_aside()
        batches = self._skipped(self._begin(epoch), skip)
        devices.set_rng_state(stop, _CPU)  # the generators stay where reading the skipped batches left them
        return batches

    def _begin(self, epoch: int) -> Iterator:
        made = getattr(self.loader, "_iterator", None) is None or not self._persistent()
        self.noted = {"epoch": epoch, "rng": devices.rng_state(_CPU), "made": made,
                      "generators": [g.get_state() for g in self._generators()]}
        return iter(self.loader)

    @staticmethod
    def _skipped(batches: Iterator, skip: int) -> Iterator:
        for _ in range(skip):
            next(batches, None)
        return batches

    def _stateful(self, saved: dict | None, epoch: int, skip: int) -> Iterator:
        """A StatefulDataLoader goes on from its own state after the batches used: kept for the last
        few positions, since a prefetcher reads ahead of the step (on CUDA)."""
        kept = dict(saved.get("loader_at", ())) if saved is not None else {}
        if skip and saved.get("epoch") != epoch:
            kept = {}
        # a new epoch after a checkpoint at an epoch's end: the loader's state at that end
        state = kept.get(skip) if skip else (kept[max(kept)] if kept else None)
        self.noted, self.recent = {"epoch": epoch}, collections.deque(maxlen=_AHEAD)
        if state is None:
            return self._recorded(self._skipped(iter(self.loader), skip), skip)
        self.loader.load_state_dict(state)
        stop = devices.rng_state(_CPU)
        batches = iter(self.loader)  # goes on from its state: what it draws now, the straight run drew before
        devices.set_rng_state(stop, _CPU)
        return self._recorded(batches, skip)

    def _recorded(self, batches: Iterator, position: int) -> Iterator:
        """The batches, each position's loader state noted (the state after `position` batches)."""
        self.recent.append((position, self.loader.state_dict()))
        for batch in batches:
            position += 1
            self.recent.append((position, self.loader.state_dict()))
            yield batch

    def _persistent(self) -> bool:
        return bool(self.loader.num_workers and getattr(self.loader, "persistent_workers", False))

    def _make_iterator_aside(self) -> None:
        """Start persistent workers without moving any RNG, so that the next `iter()` resets their
        iterator and draws the epoch's order as the run that wrote the checkpoint did."""
        if not self._persistent() or self.loader._iterator is not None:
            return
        generators = self._generators()
        states, rngs = [g.get_state() for g in generators], devices.rng_state(_CPU)
        iter(self.loader)
        devices.set_rng_state(rngs, _CPU)
        for generator, state in zip(generators, states):
            generator.set_state(state)

    def _generators(self) -> list:
        """Every torch.Generator the loader, its sampler and batch sampler hold, once each."""
        found = {}
        for holder in _holders(self.loader):
            for value in vars(holder).values():
                if isinstance(value, torch.Generator):
                    found.setdefault(id(value), value)
        return list(found.values())

    def state_dict(self) -> dict:
        saved = dict(self.noted or {})
        saved["resets_next"] = self._persistent() and getattr(self.loader, "_iterator", None) is not None
        if self.stateful:
            saved["loader_at"] = [list(pair) for pair in self.recent]
        return saved

    def load_state_dict(self, saved: dict | None) -> None:
        self.pending = saved


def _holders(loader) -> list:
    """The loader and the objects that draw its order."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = [loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    return [h for h in holders if h is not None and hasattr(h, "__dict__")]


def warn_unresumable(loader) -> None:
    """One warning, before training, for a user's DataLoader that a mid-epoch resume cannot
    reproduce exactly, naming why; a StatefulDataLoader resumes through its own state."""
    reason = unresumable_reason(loader)
    if reason is not None:
        warnings.warn(f"A run on this DataLoader cannot resume exactly after a stop: {reason}",
                      RuntimeWarning, stacklevel=3)


def unresumable_reason(loader) -> str | None:
    if callable(getattr(loader, "state_dict", None)):
        return None
    if isinstance(loader.dataset, IterableDataset):
        return (f"its dataset is an IterableDataset ({type(loader.dataset).__name__}), whose position gpunb "
                "cannot save: a resumed run reads the stream again and skips the batches used, which "
                "gives the same batches only if the stream is the same each time. HINT: use a map-style "
                "Dataset, or torchdata's `StatefulDataLoader` with a dataset that has `state_dict()`.")
    for holder in _holders(loader)[1:]:
        for name, value in vars(holder).items():
            if isinstance(value, _OWN_RNGS):
                return (f"its {type(holder).__name__} draws from its own {type(value).__module__}."
                        f"{type(value).__name__} (`{name}`), whose state gpunb cannot see, so a resumed run "
                        "would see another order. HINT: give the sampler a `torch.Generator` "
                        "(`generator=`), or let it draw from torch's global RNG.")
    if loader.num_workers and getattr(loader, "persistent_workers", False):
        return ("with `persistent_workers=True` its workers keep their RNG states from one epoch to the "
                "next, which a checkpoint cannot hold: random draws in the Dataset or collate_fn differ "
                "after a resume. HINT: `persistent_workers=False`, or draws that do not depend on them.")
    return None
