"""Validation: when a run scores its weights on held-out data, and how.

    passes.py          when passes run (epoch ends, every N steps, once at the end) and what they record
    sums.py            one pass over a feed: loss and metric sums, every sample counted once
    monitor.py         a monitored metric: its name, which way is better, whether the run produces it
    early_stopping.py  the ready-made EarlyStopping callback
"""
