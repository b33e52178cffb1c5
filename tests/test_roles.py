"""The fit roles are named once (gpunb.runtime.roles) and every user follows that list."""

import pickle
from dataclasses import fields

import pytest

from gpunb.distributed.shipping import FitArgs
from gpunb.errors import GpunbError
from gpunb.profiling import profile
from gpunb.runtime import roles


def test_the_roles_in_order():
    assert roles.NAMES == ("model", "train_data", "val_data", "optimizer", "scheduler", "loss_fn", "step",
                           "metrics", "callbacks")
    assert roles.REQUIRED == ("model", "train_data")
    assert roles.OPTIONAL_SETUP == ("val_data", "optimizer", "scheduler", "loss_fn", "step", "metrics")


def test_shipped_fit_args_are_the_config_and_the_setup_roles():
    # The roles, then the run's state class (runtime.run_state.RunState unless a subclass is given).
    assert [f.name for f in fields(FitArgs)] == ["config", *roles.SETUP, "state_type"]
    args = FitArgs("config", "model", "data", loss_fn="loss")  # the launcher builds it positionally
    assert pickle.loads(pickle.dumps(args)) == args and args.step is None and args.state_type is None


def test_profile_train_lists_the_roles_it_takes():
    with pytest.raises(GpunbError, match="val_data, optimizer, scheduler, loss_fn, step, metrics"):
        profile(train={"model": object(), "train_data": object(), "callbacks": []})


def test_every_role_is_a_gputrain_option():
    from gpunb.notebook.magics import GpuMagics

    doc = GpuMagics.gputrain.__doc__
    for name in roles.NAMES:
        assert f"--{name.replace('_', '-')}" in doc


def test_the_kind_checks_live_in_the_runtime_and_the_magic_names_the_variable(ip):
    import torch
    from IPython.core.error import UsageError

    from gpunb import Trainer

    with pytest.raises(roles.RoleError) as error:
        Trainer(track=False).fit(torch.nn.Linear(2, 2), (torch.randn(4, 2), torch.zeros(4).long()), optimizer=3)
    assert error.value.role == "optimizer" and "must be a torch.optim.Optimizer, got a int" in str(error.value)
    cell = "model = torch.nn.Linear(2, 2)\ntrain_data = (torch.randn(4, 2), torch.zeros(4).long())\nopt = 3"
    ip.run_cell("import torch")
    with pytest.raises(UsageError) as usage:
        ip.run_cell_magic("gputrain", "--optimizer opt --no-track --quiet", cell)
    assert str(usage.value).startswith("`opt`: `optimizer` must be a torch.optim.Optimizer, got a int.")
