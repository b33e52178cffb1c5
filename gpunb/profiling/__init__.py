"""%gpuprofile's engine: torch.profiler capture -> analysis -> advice.

    result = gpunb.profiling.profile(lambda: train_step(batch))         # any callable
    result = gpunb.profiling.profile(train=dict(model=m, train_data=d))  # Trainer steps
    result.advice   # what to change, with the evidence and an estimated gain

Nothing here touches CUDA or NVML at import time.
"""

from gpunb.profiling.api import ProfilerCallback, profile
from gpunb.profiling.report import Advice, ProfileResult

__all__ = ["profile", "ProfileResult", "Advice", "ProfilerCallback"]
