"""Probes: what a run learns about itself before its first step, leaving no trace.

    preflight.py   the data is not empty, and one batch goes through model and loss
    explain.py     why a batch failed, in the user's terms (which layer, which target, which key)
    batch_size.py  `batch_size="auto"`: the largest batch that fits, chosen the same on a re-run
    lr_find.py     the learning-rate range test
    summary.py     parameters, FLOPs and memory before the first step
    peak_flops.py  the dense peak TFLOPS of known GPUs, per precision: the denominator of MFU
"""
