"""Loggers: callbacks that write a run to CSV, TensorBoard, MLflow or Weights & Biases.

    Trainer(loggers=["tensorboard", "csv"])          by name (TrainConfig.loggers)
    Trainer(loggers=[MLflowLogger(experiment="x")])  or as objects
    %%gputrain --log tensorboard,csv

Each writes on rank 0 only. The optional packages are imported when a logger is made,
so a missing one is an error before training starts, and so is a directory it cannot
write in. A logger that fails later warns once and is switched off (loggers/base.py).
"""

from gpunb.loggers.base import check_destinations
from gpunb.loggers.csv_logger import CSVLogger
from gpunb.loggers.mlflow_logger import MLflowLogger
from gpunb.loggers.tensorboard_logger import TensorBoardLogger
from gpunb.loggers.wandb_logger import WandbLogger

_BY_NAME = {"csv": CSVLogger, "tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}


def make_loggers(config) -> list:
    """The loggers `config.loggers` names (made here), and the logger objects it holds; each
    can write where it will (checked here, before any work)."""
    loggers = [_BY_NAME[item]() if isinstance(item, str) else item for item in config.loggers]
    check_destinations(loggers, config)
    return loggers


__all__ = ["CSVLogger", "TensorBoardLogger", "MLflowLogger", "WandbLogger", "make_loggers"]
