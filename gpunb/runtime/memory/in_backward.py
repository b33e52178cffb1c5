"""The optimizer's step fused into backward: each parameter steps as soon as its gradient is complete.

One optimizer per parameter (torchtune's single-device recipes do the same), stepped by the
parameter's post-accumulate-grad hook, which then drops the gradient: the step never holds
more than the gradients backward is still producing, instead of all of them.

It is the same update as one optimizer over all parameters when each step sees the whole
batch's gradient at once, so the plan allows it only without what needs every gradient
before any step: gradient clipping (a global norm), accumulation over micro-batches, the fp16
loss scaler (it checks all gradients for inf first), several processes (DDP reduces the
gradients after backward).

To the loop it reads as one optimizer: `step()` and `zero_grad()` do nothing (backward did
both), its `param_groups` are the per-parameter ones (a schedule sets each one's rate), and
`state_dict()` has the layout of the optimizer it replaces, so a checkpoint loads into either.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class OptimizerInBackward(torch.optim.Optimizer):
    """Per-parameter optimizers made by `make([group])`, for each parameter of `groups`."""

    steps_in_backward = True  # no CUDA graph of the whole step (step_graph.blocker)

    def __init__(self, groups: list[dict], make):
        self._layout = []  # per original group: its per-parameter optimizers, in order
        self._hooks = []
        self._stepped = set()  # ids of the parameters stepped in this step (an OOM replay skips them)
        for group in groups:
            hyper = {key: value for key, value in group.items() if key != "params"}
            inners = [make([{**hyper, "params": [param]}]) for param in group["params"]]
            self._layout.append(inners)
            for param, inner in zip(group["params"], inners):
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._step_hook(inner)))
        first = self._layout[0][0] if self._layout and self._layout[0] else None
        self.defaults = dict(first.defaults) if first is not None else {}
        self.inner_type = type(first).__name__ if first is not None else "Optimizer"
        self.checkpoint_type = self.inner_type  # its state_dict() is one of those: a checkpoint says so
        # torch.optim.Optimizer's bookkeeping that torch's schedulers and hooks read
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    def _step_hook(self, inner):
        def step_now(param):
            if id(param) not in self._stepped:  # a replayed step: updated once only
                self._stepped.add(id(param))
                inner.step()
            param.grad = None  # freed as soon as it is used
        return step_now

    @property
    def param_groups(self) -> list:
        return [inner.param_groups[0] for inners in self._layout for inner in inners]

    @property
    def state(self) -> dict:
        return {param: state for inners in self._layout for inner in inners for param, state in inner.state.items()}

    def step(self, closure=None):
        """Backward already stepped every parameter; this closes the step."""
        self._stepped.clear()
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A loop of our own, not each inner optimizer's zero_grad (a profiler range per parameter,
        # every step); backward's hooks have already freed the gradients they stepped.
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    def close(self) -> None:
        """Removes the hooks: the model's backward steps nothing any more."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def state_dict(self) -> dict:
        """The layout of one optimizer over the original groups (parameters numbered in order)."""
        state, groups, index = {}, [], 0
        for inners in self._layout:
            numbers = []
            for inner in inners:
                own = inner.state_dict()["state"]
                if 0 in own:
                    state[index] = own[0]
                numbers.append(index)
                index += 1
            hyper = {k: v for k, v in inners[0].param_groups[0].items() if k != "params"} if inners else {}
            groups.append({**hyper, "params": numbers})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        for inners, group in zip(self._layout, state_dict["param_groups"]):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for inner, number in zip(inners, group["params"]):
                own = {0: state_dict["state"][number]} if number in state_dict["state"] else {}
                inner.load_state_dict({"state": own, "param_groups": [{**hyper, "params": [0]}]})

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("the optimizer in backward holds the parameters it was built with")

    def __repr__(self) -> str:
        return f"OptimizerInBackward({self.inner_type}, {sum(map(len, self._layout))} parameters)"
