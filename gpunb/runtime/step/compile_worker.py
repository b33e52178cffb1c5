"""The compile worker: a spawned process that compiles the training step while training goes on.

torch.compile is not thread safe (pytorch#168042), so the compile runs in a process of its
own (compile_beside.Worker starts it). It gets the model's structure, not its weights: each parameter and buffer travels as
its shape, strides, dtype and device and is made anew there (`_materialized`), so a model of
billions of parameters costs a few kilobytes to send, and a parameter tied to another stays
tied (pickle sends an object it has sent once as a reference). The compiled code depends on
the shapes, not the values. cloudpickle carries the notebook's classes and functions by value.

The worker compiles the model (and the loss_fn) as CompiledEngine does, runs one forward
and backward on a micro-batch of the training shapes under the run's autocast, and answers
("ok", seconds, save_cache_artifacts() bytes) or ("failed", what went wrong). What it
compiled stays in the Inductor cache directory it shares with the training process
(TORCHINDUCTOR_CACHE_DIR, set in its environment).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import time

import cloudpickle
import torch


class _StructurePickler(cloudpickle.Pickler):
    """cloudpickle, with the model's parameters and buffers sent as their description."""

    def __init__(self, file, model: torch.nn.Module):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.described = {id(t) for t in (*model.parameters(), *model.buffers())}

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and id(obj) in self.described:
            return _materialized, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, str(obj.device),
                                   obj.requires_grad, isinstance(obj, torch.nn.Parameter))
        return super().reducer_override(obj)


def _materialized(shape, stride, dtype, device, requires_grad, parameter):
    """A tensor of the described layout with harmless values: small for weights, ones for
    floating buffers (a running variance must stay positive), zeros for integers."""
    tensor = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    with torch.no_grad():
        if not tensor.is_floating_point():
            tensor.zero_()
        elif parameter:
            tensor.uniform_(-0.05, 0.05)
        else:
            tensor.fill_(1.0)
    return torch.nn.Parameter(tensor, requires_grad) if parameter else tensor


def ship(model, objective, piece, autocast_dtype, mode, backend) -> bytes:
    """What the worker needs, as bytes. Raises when something cannot be pickled."""
    job = {"model": model, "loss_fn": objective.loss_fn, "step_fn": objective.step_fn,
           "model_loss": objective.model_loss, "piece": piece, "autocast_dtype": autocast_dtype,
           "mode": mode, "backend": backend, "training": model.training, "settings": settings()}
    buffer = io.BytesIO()
    _StructurePickler(buffer, model).dump(job)
    return buffer.getvalue()


def settings() -> dict:
    """This process's global settings that Inductor's cache keys read (its compiled code differs
    with them): the worker takes them on, so that what it compiles is what training looks up."""
    return {"threads": torch.get_num_threads(), "matmul": torch.get_float32_matmul_precision(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "fill": torch.utils.deterministic.fill_uninitialized_memory, "dtype": torch.get_default_dtype(),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                      torch.backends.cudnn.allow_tf32)}


def _take_on(given: dict) -> None:
    torch.set_num_threads(given["threads"])
    if torch.get_float32_matmul_precision() != given["matmul"]:  # setting it names it: a key of its own
        torch.set_float32_matmul_precision(given["matmul"])
    torch.use_deterministic_algorithms(given["deterministic"][0], warn_only=given["deterministic"][1])
    torch.utils.deterministic.fill_uninitialized_memory = given["fill"]
    torch.set_default_dtype(given["dtype"])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.allow_tf32) = given["cudnn"]


def main() -> None:
    """The worker process's whole life: read the job from stdin, compile, run once, answer on
    stdout, exit. Anything else written to stdout goes to stderr, so the answer stays whole."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        path, payload = pickle.loads(sys.stdin.buffer.read())
        sys.path[:] = path
        job = pickle.loads(payload)
        seconds = _compile_and_run(job)
        saved = torch.compiler.save_cache_artifacts()
        answer = ("ok", seconds, saved[0] if saved else None)
    except BaseException as error:  # noqa: BLE001 - whatever it is, the training process hears it
        from gpunb.runtime.step.engines import error_text

        answer = ("failed", error_text(error))
    with contextlib.suppress(OSError):  # the training process is gone: nobody to tell
        answers.write(pickle.dumps(answer))
        answers.close()


def _compile_and_run(job: dict) -> float:
    from gpunb.runtime.step.objective import Objective

    began = time.perf_counter()
    _take_on(job["settings"])
    model = job["model"].train(job["training"])
    options = {"mode": job["mode"]} if isinstance(job["mode"], str) else {}
    compiled = torch.compile(model, backend=job["backend"], **options)
    loss_fn = job["loss_fn"]
    compiled_loss_fn = torch.compile(loss_fn, backend=job["backend"], **options) if loss_fn is not None else None
    objective = Objective(loss_fn, job["step_fn"])
    objective.model_loss = job["model_loss"]
    piece, dtype = job["piece"], job["autocast_dtype"]
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
        loss = objective.loss(compiled, piece, compiled_loss_fn)
    loss.backward()  # compiles the backward graph (AOTAutograd compiles it at its first call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


if __name__ == "__main__":
    main()
