"""Cost of the live dashboard: %%gputrain with and without it, in a real kernel.

Runs the same seeded digits training in one Jupyter kernel (nbclient), alternating
`--quiet` (no dashboard) and the live dashboard, and compares median step times.
The kernel's front end is nbclient, so widget messages are really sent over ZMQ.

    python benchmarks/dashboard.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics

import nbformat
from nbclient import NotebookClient

SETUP = """
%load_ext gpunb
import torch, time
from torch import nn
from gpunb.demo import digits_data, digits_cnn
(x, y), _ = digits_data()
class StepClock:
    def __init__(self): self.times, self.last = [], None
    def on_fit_start(self, state): self.last = time.perf_counter()
    def on_step_end(self, state):
        now = time.perf_counter(); self.times.append(now - self.last); self.last = now
"""

RUN = """
%%gputrain --epochs 3 --batch-size 32 --log-every 5 --no-track {quiet}
torch.manual_seed(0)
model = digits_cnn()
train_data = (x, y)
loss_fn = nn.CrossEntropyLoss()
clock = StepClock()
callbacks = [clock]
"""

REPORT = "import statistics, json; print(json.dumps(statistics.median(clock.times[10:])))"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cells = [SETUP]
    labels = []
    for _ in range(args.rounds):
        for label in ("quiet", "dashboard"):
            cells += [RUN.format(quiet="--quiet" if label == "quiet" else ""), REPORT]
            labels.append(label)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(notebook, timeout=1200, kernel_name="python3").execute()
    medians = {"quiet": [], "dashboard": []}
    for label, cell in zip(labels, notebook.cells[2::2]):
        text = [o.text for o in cell.outputs if o.output_type == "stream"][-1]
        medians[label].append(json.loads(text.strip().splitlines()[-1]))
    quiet, live = statistics.median(medians["quiet"]), statistics.median(medians["dashboard"])
    print(f"median step: quiet {1000 * quiet:.3f} ms, with dashboard {1000 * live:.3f} ms, "
          f"ratio {live / quiet:.4f} (overhead {100 * (live / quiet - 1):+.2f}%)")


if __name__ == "__main__":
    main()
