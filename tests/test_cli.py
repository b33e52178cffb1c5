"""The `gpunb` command the README's first set-up line runs."""

from gpunb.cli import main


def test_demo_trains_the_digits_cnn_and_prints_the_result(capsys):
    assert main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "TrainResult('digits-cnn': completed, 2 epochs, 90 steps" in out
    accuracy = float(out.split("val_acc=")[1].split()[0])
    assert accuracy > 0.9


def test_status_without_a_gpu_shows_the_host(capsys):
    assert main(["status"]) == 0
    assert "RAM" in capsys.readouterr().out


def test_a_bad_option_is_an_error_not_a_traceback(capsys):
    assert main(["demo", "--precision", "fp8"]) == 2
    assert "Unknown precision 'fp8'" in capsys.readouterr().err


def test_the_demo_takes_every_trainconfig_option(capsys):
    assert main(["demo", "--max-steps", "3", "--no-track", "--batch-size", "64", "--lr-schedule", "none"]) == 0
    assert "TrainResult('digits-cnn': completed, 1 epochs, 3 steps" in capsys.readouterr().out
    assert main(["demo", "--save-top-k", "2"]) == 2
    assert "pass `--checkpoint-dir checkpoints` too" in capsys.readouterr().err  # the fix, as a flag
