"""Compiling beside eager steps, as the training process sees it: the engine that finds a
micro-batch of the training shapes, the worker's process, and whether it fits on the GPU.

The first step runs on `Sampling`, an eager engine that keeps its first micro-batch. The
worker (compile_worker.py) gets the model's structure, the objective, that micro-batch and
the precision, compiles the step in its own process and runs it once, sharing the Inductor
cache directory (compile_cache.py) with this process; training goes on eagerly meanwhile.
`Worker.poll()` is asked at step ends (a select on a pipe: no wait); once the worker is
done, this process compiles from the warm cache (compiling.py). A worker that dies, or a
compile that fails there, leaves training eager; `stop()` leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
import time

import torch


SMALL_HOST_CPUS = 4  # at most this many cores: the worker compiles in one process (no pool of its own)
CONTEXT_BYTES = 2**30  # a CUDA context and the compile's own workspace, beside the step's memory


class Sampling:
    """The engine of the run's first step: eager, keeping the step's first micro-batch."""

    whole_steps = graphed = compiles = False

    def __init__(self, engine):
        self.engine, self.piece = engine, None
        self.model, self.eval_model, self.eager = engine.model, engine.eval_model, None

    def loss(self, piece) -> torch.Tensor:
        if self.piece is None:
            self.piece = piece
        return self.engine.loss(piece)

    def whole_step(self, stepper, batch) -> None:
        return None

    def close(self) -> None:
        pass  # the eager engine goes on


class Worker:
    """The compile worker's process: started with the job's bytes, asked at step ends, stopped.

    A fresh interpreter (`python -m gpunb.runtime.step.compile_worker`), not multiprocessing's
    spawn: spawn runs the main script again in the child, which in a script without a
    `__main__` guard would start the training again there. The job goes in on its stdin and
    the answer comes back on its stdout, each through a daemon thread: the worker reads only
    once it has imported torch, and writes an answer (the artifacts) larger than a pipe holds."""

    def __init__(self, payload: bytes, cache_dir: str):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}  # shared with the training process
        if (os.cpu_count() or 1) <= SMALL_HOST_CPUS:  # a pool of compile processes would only compete with training
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        log = _log()
        self.process = subprocess.Popen([sys.executable, "-m", "gpunb.runtime.step.compile_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        if log is not subprocess.DEVNULL:
            log.close()  # the child has its own
        self.began = time.perf_counter()
        self.answer: list = []
        job = pickle.dumps((sys.path, payload))  # the worker imports what this process can
        threading.Thread(target=_send, args=(self.process.stdin, job), daemon=True, name="gpunb-compile-job").start()
        self.reader = threading.Thread(target=_receive, args=(self.process.stdout, self.answer), daemon=True,
                                       name="gpunb-compile-answer")
        self.reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> tuple | None:
        """None while it compiles; else ("ok", seconds, artifacts) or ("failed", why); the process
        is stopped once it has answered."""
        if self.reader.is_alive():
            return None
        self.stop()
        return self.answer[0] if self.answer else ("failed", f"the compile worker died (exit code "
                                                             f"{self.process.returncode})")

    def stop(self) -> None:
        """End the process (if it still runs) and wait for it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        self.reader.join(5)


def _log():
    """Where the worker's stderr goes: GPUNB_COMPILE_WORKER_LOG's file (appended), else nowhere
    (Inductor's warnings would land in the notebook's output)."""
    path = os.environ.get("GPUNB_COMPILE_WORKER_LOG")
    return open(path, "ab") if path else subprocess.DEVNULL  # noqa: SIM115 - closed once the child has it


def _send(pipe, job: bytes) -> None:
    try:
        pipe.write(job)
    except OSError:
        pass  # the worker died before reading: poll() reports it
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def _receive(pipe, answer: list) -> None:
    """The worker's answer, whole, once it has closed its stdout (at its exit)."""
    data = pipe.read()
    pipe.close()
    with contextlib.suppress(Exception):  # a worker killed mid-answer sent nothing readable
        answer.append(pickle.loads(data))


def memory_blocker(device: torch.device) -> str | None:
    """Why the worker would not fit beside training on this GPU (None: it fits, or no GPU). The
    worker needs about what the training process's step took at its peak (the model, its
    gradients, one micro-batch's activations; the optimizer's state makes it an overestimate),
    measured over the steps run so far, plus a CUDA context."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    need = torch.cuda.max_memory_allocated(device) + CONTEXT_BYTES
    if need <= free:
        return None
    return (f"the compile worker would need ~{need / 2**30:.1f} GiB of GPU memory beside training, "
            f"and {free / 2**30:.1f} GiB are free")
