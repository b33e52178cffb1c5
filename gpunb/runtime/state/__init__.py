"""A run's state on disk and back: checkpoints, resume, continue, and guards around them.

    checkpoint_files.py  checkpoint files: written atomically, listed, found, read with weights_only=True
    checkpointer.py      checkpointing as a callback (when to save, what goes in) and resuming a run
    best_k.py            the k best checkpoints of a run by a monitored validation metric
    resume_check.py      whether a checkpoint fits the run that wants to resume from it
    resume_target.py     which checkpoint `resume=` means, and which run directory the resumed run writes into
    run_lock.py          the lock that says a run directory is in use by a live run
    continuing.py        `continue_from`: a fit that goes on where the last one stopped
    rewind.py            model, optimizer and RNGs captured and put back exactly (for probes)
    nan_guard.py         the step losses of a log interval, the first non-finite one, what to do
"""
