import pytest

from gpunb import TrainConfig
from gpunb.errors import GpunbError


def test_shorthands_are_parsed_once():
    config = TrainConfig(precision="bf16", lr_schedule="OneCycle", batch_size="auto", accelerator="gpu")
    assert config.precision == "bf16-mixed"
    assert config.lr_schedule == "one-cycle"
    assert config.batch_size == "auto"
    assert config.accelerator == "cuda"
    assert TrainConfig(precision="fp16").precision == "16-mixed"
    assert TrainConfig(batch_size="128").batch_size == 128


@pytest.mark.parametrize("field,value,fix", [
    ("precision", "fp8", "bf16-mixed"),
    ("batch_size", 0, "batch_size=64"),
    ("batch_size", "big", "auto"),
    ("epochs", -1, "epochs=1"),
    ("lr_schedule", "linear", "one-cycle"),
    ("clip_grad_norm", -1.0, "clip_grad_norm=1.0"),
    ("strategy", "deepspeed", "fsdp"),
    ("num_workers", -2, ">= 0"),
])
def test_bad_values_name_the_fix(field, value, fix):
    with pytest.raises(GpunbError) as error:
        TrainConfig(**{field: value})
    assert fix in str(error.value)
    assert field in str(error.value)


def test_misspelt_option_suggests_the_right_one():
    with pytest.raises(GpunbError, match="did you mean `grad_accum`"):
        TrainConfig().replace(grad_acum=2)


def test_resume_last_needs_a_directory():
    with pytest.raises(GpunbError, match="checkpoint_dir"):
        TrainConfig(resume="last")


def test_to_dict_is_json_safe():
    import json

    from gpunb.runtime.feed.transforms import RandomFlip

    text = json.dumps(TrainConfig(transforms=(RandomFlip(),)).to_dict())
    assert "RandomFlip" in text
