"""DataLoader workers with data defined in a notebook, under every start method.

Each case runs in a fresh interpreter whose code lives in `__main__` without a file
(`python -c`), as a notebook's does: spawn and forkserver workers cannot import it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gpunb.runtime.feed.workers import for_workers, start_method

PRELUDE = textwrap.dedent("""
    import json, multiprocessing, os, sys, threading, warnings
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from gpunb import Trainer

    multiprocessing.set_start_method(sys.argv[1])

    class Squares(torch.utils.data.Dataset):  # defined in __main__, as in a notebook cell
        def __init__(self, n=64):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 4, generator=g)
            self.y = (self.x.sum(1) > 0).long()
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            if torch.utils.data.get_worker_info() is not None:
                open(os.environ["WORKER_MARK"], "a").close()  # a worker process read this item
            return self.x[i], self.y[i]

    def fit(data):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = Trainer(epochs=2, batch_size=16, num_workers=1, track=False).fit(
                model, data, loss_fn=nn.CrossEntropyLoss())
        notes = [str(w.message) for w in caught if "DataLoader workers" in str(w.message)]
        return {"steps": result.steps, "weight": model.weight.sum().item(), "notes": notes,
                "in_workers": os.path.exists(os.environ["WORKER_MARK"])}
""")


def run_main(body: str, method: str, tmp_path) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), WORKER_MARK=str(tmp_path / "read-in-a-worker"))
    done = subprocess.run([sys.executable, "-c", code, method], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


METHODS = [m for m in ("spawn", "forkserver") if m in __import__("multiprocessing").get_all_start_methods()]


@pytest.mark.parametrize("method", METHODS)
def test_a_notebook_dataset_reaches_spawned_workers_and_trains_as_in_process(method, tmp_path):
    out = run_main("""
        try:  # the failure gpunb avoids: a plain DataLoader's workers cannot find the class
            next(iter(DataLoader(Squares(), batch_size=8, num_workers=1)))
            plain = "worked"
        except Exception as error:
            plain = type(error).__name__
        assert not os.path.exists(os.environ["WORKER_MARK"])
        workers = fit(Squares())
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        Trainer(epochs=2, batch_size=16, num_workers=0, track=False).fit(model, Squares(),
                                                                          loss_fn=nn.CrossEntropyLoss())
        print(json.dumps({"plain": plain, "workers": workers, "in_process": model.weight.sum().item()}))
    """, method, tmp_path)
    assert out["plain"] != "worked"
    assert out["workers"]["steps"] == 8 and out["workers"]["notes"] == []
    assert out["workers"]["in_workers"]
    assert out["workers"]["weight"] == pytest.approx(out["in_process"], abs=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_a_users_dataloader_with_a_notebook_collate_fn_is_rebuilt_to_reach_its_workers(method, tmp_path):
    out = run_main("""
        collate = lambda rows: (torch.stack([r[0] for r in rows]) * 2, torch.stack([r[1] for r in rows]))
        loader = DataLoader(Squares(), batch_size=16, num_workers=2, collate_fn=collate,
                            multiprocessing_context=sys.argv[1])
        print(json.dumps(fit(loader)))
    """, method, tmp_path)
    assert out["steps"] == 8 and out["notes"] == [] and out["in_workers"]


def test_what_cannot_be_pickled_is_loaded_in_process_with_one_warning(tmp_path):
    out = run_main("""
        class Locked(Squares):
            def __init__(self):
                super().__init__()
                self.lock = threading.Lock()  # no pickle carries a lock
        print(json.dumps(fit(Locked())))
    """, "spawn", tmp_path)
    assert out["steps"] == 8 and not out["in_workers"]
    assert len(out["notes"]) == 1
    note = out["notes"][0]
    assert "start with 'spawn'" in note and "num_workers=0" in note and "lock" in note


def test_fork_and_importable_data_are_left_as_they_are():
    from torch.utils.data import TensorDataset
    import torch

    data = {"dataset": TensorDataset(torch.zeros(4, 2))}
    assert for_workers(data, 2, "spawn") == (data, 2, None)  # pickles by reference: nothing to do
    assert for_workers({"dataset": lambda i: i}, 2, "fork")[1:] == (2, None)
    assert for_workers({"dataset": lambda i: i}, 0, "spawn")[1:] == (0, None)
    objects, workers, method = for_workers({"dataset": lambda i: i}, 2, "spawn")
    assert (workers, method) == (2, "spawn") and objects["dataset"](3) == 3


def test_the_start_method_is_the_loaders_own_else_the_default():
    import multiprocessing

    assert start_method("spawn") == "spawn"
    assert start_method(multiprocessing.get_context("forkserver")) == "forkserver"
    assert start_method() in multiprocessing.get_all_start_methods()
