"""The feed: what the user passed as data, turned into batches on the training device.

    inputs.py       the user's data as tensors, a Dataset or a DataLoader; batch helpers (size, slice, move)
    feeds.py        where each epoch's batches come from: a tensor feed or a DataLoader feed, sharded, resumable
    prefetch.py     the next batch prepared on a side stream while the current step computes
    producer.py     items prepared in a thread of their own, a bounded number ahead of their user
    workers.py      DataLoader workers that start under any start method, with data defined in a notebook
    batch_seeds.py  randomness in DataLoader workers that depends only on (seed, epoch, batch)
    augmenter.py    applies a run's transforms to each batch on the device, with the batch's own RNG
    transforms.py   ready-made device transforms: Normalize, RandomFlip, RandomCrop
"""
