"""PEFT (LoRA) models, first class: adapters train, checkpoints hold what trains, adapters merge.

The model is a tiny Llama built from a LlamaConfig (nothing is downloaded), wrapped by
`peft.get_peft_model`; the data counts tokens up from a random start (learnable next tokens).
"""

import pytest
import torch
from conftest import classification_data, mlp
from test_checkpoint import InterruptAt, StopAt
from torch import nn
from torch.utils.data import Dataset

import gpunb
from gpunb import Trainer
from gpunb.errors import GpunbError
from gpunb.runtime.state.checkpoint_files import list_checkpoints, load_checkpoint

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
# peft asks a transformers model `is_gradient_checkpointing`, which transformers 5 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

VOCAB, LENGTH = 64, 16


def tiny_llama(seed=0, layers=2, hidden=32):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=LENGTH)
    return transformers.LlamaForCausalLM(config)


def lora_llama(seed=0, base_seed=0, dropout=0.1):
    """LoRA on the attention's q and v projections; `seed` draws the adapters' initial weights."""
    base = tiny_llama(base_seed)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=dropout,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(base, config)


class CountingText(Dataset):
    def __init__(self, n=64, seed=0):
        starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts + torch.arange(LENGTH)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(model, epochs=2, data=None, **options):
    settings = dict(batch_size=16, lr=1e-2, log_every=2, track=False, accelerator="cpu", epochs=epochs)
    settings.update(options)
    callbacks = settings.pop("callbacks", ())
    optimizer = settings.pop("optimizer", None)
    return Trainer(**settings).fit(model, data if data is not None else CountingText(), optimizer=optimizer,
                                   callbacks=callbacks)


def trainable_state(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def frozen_state(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}


def assert_equal_states(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# --- training ----------------------------------------------------------------------------------

def test_only_the_adapters_train_bit_for_bit_as_in_a_plain_loop():
    model, plain = lora_llama(dropout=0.0), lora_llama(dropout=0.0)
    base = frozen_state(model)
    result = fit(model, epochs=2, shuffle=False)

    # The same steps written by hand: the default optimizer is fused AdamW over what trains.
    params = [p for p in plain.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    data = CountingText()
    plain.train()
    for _ in range(2):
        for start in range(0, len(data), 16):
            batch = {key: value[start:start + 16] for key, value in
                     {"input_ids": data.ids, "labels": data.ids}.items()}
            plain(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    assert result.steps == 8
    assert_equal_states(trainable_state(model), trainable_state(plain))
    assert_equal_states(frozen_state(model), base)  # the base has not moved
    assert any(not torch.equal(a, b) for a, b in zip(trainable_state(model).values(),
                                                     trainable_state(lora_llama(dropout=0.0)).values()))
    # the optimizer gpunb built holds the adapters only
    held = {id(p) for p in result.continue_state.optimizer.param_groups[0]["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}


def test_a_users_optimizer_over_every_parameter_is_kept_as_is_and_the_base_stays():
    model = lora_llama()
    base = frozen_state(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the frozen ones too
    fit(model, epochs=1, optimizer=optimizer)
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))
    updated = {id(p) for p in optimizer.state}
    assert updated == {id(p) for p in model.parameters() if p.requires_grad}  # frozen: no grad, no step
    assert_equal_states(frozen_state(model), base)


def test_the_result_and_its_summary_say_what_trains_and_what_is_frozen():
    model = lora_llama()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    result = fit(model, epochs=1)
    assert (result.trainable_params, result.frozen_params) == (trainable, frozen)
    assert trainable == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)  # 2 layers x (q: A 4x32, B 32x4; v: A 4x32, B 16x4)
    share = f"{100 * trainable / (trainable + frozen):.3g}%"
    assert f"parameters: {trainable:,} trainable ({share}), {frozen:,} frozen" in repr(result)
    assert f"({trainable:,} trainable, {frozen:,} frozen)" in repr(result.summary)
    assert ("parameters", f"{trainable:,} trainable ({share}), {frozen:,} frozen") in gpunb.render.summary_rows(result)
    # a model without frozen parameters says nothing new
    plain = Trainer(epochs=1, track=False, accelerator="cpu").fit(mlp(), classification_data(),
                                                                  loss_fn=nn.CrossEntropyLoss())
    assert "parameters:" not in repr(plain)


def test_predict_runs_the_peft_model():
    model = lora_llama()
    fit(model, epochs=1)
    data = CountingText(n=20, seed=3)
    logits = gpunb.predict(model, data, batch_size=8)["logits"]  # the output's fields, concatenated
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=data.ids).logits
    assert logits.shape == (20, LENGTH, VOCAB)
    torch.testing.assert_close(logits, expected)


# --- checkpoints -------------------------------------------------------------------------------

def full_fine_tune_size(tmp_path):
    """The checkpoint of the same model with every parameter training."""
    model = tiny_llama()
    fit(model, epochs=1, checkpoint_dir=tmp_path / "full")
    return list_checkpoints(tmp_path / "full")[-1].stat().st_size


def test_a_lora_checkpoint_holds_what_trains_and_a_fingerprint_of_the_base(tmp_path):
    model = lora_llama()
    fit(model, epochs=1, checkpoint_dir=tmp_path / "lora")
    path = list_checkpoints(tmp_path / "lora")[-1]
    payload = load_checkpoint(path)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name for name, _ in model.named_buffers() if name in model.state_dict()}
    assert set(payload["model"]) == trainable | buffers
    assert payload["version"] == 3
    frozen = set(model.state_dict()) - trainable - buffers
    assert set(payload["frozen"]) == frozen
    name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert payload["frozen"][name][:2] == [[32, 32], "float32"]
    # its optimizer state is the adapters' only
    assert len(payload["optimizer"]["state"]) == len(trainable)
    lora_size, full_size = path.stat().st_size, full_fine_tune_size(tmp_path)
    assert lora_size < full_size / 6, (lora_size, full_size)  # the rest: history, config, fingerprint
    weights = sum(t.numel() * t.element_size() for t in payload["model"].values())
    assert weights < 0.05 * sum(t.numel() * t.element_size() for t in model.state_dict().values())


def resume_matches_a_straight_run(tmp_path, stop=None, **options):
    straight = lora_llama()
    fit(straight, epochs=3, **options)
    callbacks = [StopAt(stop)] if stop else []
    fit(lora_llama(), epochs=2 if stop is None else 3, checkpoint_dir=tmp_path, callbacks=callbacks, **options)
    resumed = lora_llama(seed=7)  # other adapters to start with; the same base
    result = fit(resumed, epochs=3, checkpoint_dir=tmp_path, resume="last", **options)
    assert result.steps == 12
    assert_equal_states(trainable_state(resumed), trainable_state(straight))
    return result


def test_resume_from_a_lora_checkpoint_is_bit_for_bit(tmp_path):
    resume_matches_a_straight_run(tmp_path)


def test_resume_mid_epoch_with_a_schedule_and_a_weight_average_is_bit_for_bit(tmp_path):
    result = resume_matches_a_straight_run(tmp_path, stop=5, lr_schedule="cosine", ema=0.9)
    assert result.resumed_from["step"] == 5
    ema = load_checkpoint(result.checkpoint_path)["ema"]["weights"]
    assert not any("base_layer" in name for name in ema)  # the average is of what trains


def test_resuming_onto_another_base_is_refused_before_anything_loads(tmp_path):
    fit(lora_llama(), epochs=1, checkpoint_dir=tmp_path)
    other = lora_llama(base_seed=1)
    before = trainable_state(other)
    with pytest.raises(GpunbError) as error:
        fit(other, epochs=2, checkpoint_dir=tmp_path, resume="last")
    message = str(error.value)
    assert "frozen weights are not the ones it was trained on" in message
    # embeddings, projections and head differ; the 5 norms start as ones in both
    assert "other values in 16 of 21 frozen tensors: base_model.model.model.embed_tokens.weight" in message
    assert "HINT: resume onto the same base model" in message
    assert_equal_states(trainable_state(other), before)


def test_a_lora_checkpoint_never_resumes_onto_a_base_that_differs_in_one_value(tmp_path):
    fit(lora_llama(), epochs=1, checkpoint_dir=tmp_path)
    other = lora_llama()
    name = "base_model.model.model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():  # one value of 2,048, none that 16 evenly spaced samples would read
        other.get_parameter(name)[17, 5] += 1e-4
    with pytest.raises(GpunbError, match=f"other values in 1 of 21 frozen tensors: {name}"):
        fit(other, epochs=2, checkpoint_dir=tmp_path, resume="last")


def test_resuming_onto_a_base_of_another_dtype_names_the_tensors(tmp_path):
    fit(lora_llama(), epochs=1, checkpoint_dir=tmp_path)
    other = lora_llama()
    other.base_model.model.model.norm.to(torch.bfloat16)
    with pytest.raises(GpunbError, match=r"shape or dtype differs base_model.model.model.norm.weight: checkpoint "
                                         r"\(32,\) float32, model \(32,\) bfloat16"):
        fit(other, epochs=2, checkpoint_dir=tmp_path, resume="last")


def test_a_whole_checkpoint_written_before_trainable_only_ones_still_resumes(tmp_path, monkeypatch):
    from gpunb.runtime import trainable

    straight = lora_llama()
    fit(straight, epochs=3)
    with monkeypatch.context() as patched:  # how checkpoints were written before: the whole model
        patched.setattr(trainable, "has_frozen", lambda model: False)
        fit(lora_llama(), epochs=2, checkpoint_dir=tmp_path)
    payload = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert payload["version"] == 1 and payload["frozen"] is None
    assert set(payload["model"]) == set(straight.state_dict())
    resumed = lora_llama(seed=7)
    fit(resumed, epochs=3, checkpoint_dir=tmp_path, resume="last")
    assert_equal_states(trainable_state(resumed), trainable_state(straight))


def test_the_fingerprint_reads_values_not_their_layout():
    from gpunb.runtime.trainable import fingerprint

    weight = torch.randn(64, 32)
    transposed_twice = weight.t().contiguous().t()  # the same values, not contiguous
    assert fingerprint({"w": weight}) == fingerprint({"w": transposed_twice})
    moved = weight.clone()
    moved[-1, -1] += 1
    assert fingerprint({"w": moved})["w"][2] != fingerprint({"w": weight})["w"][2]
    assert fingerprint({"w": weight.to(torch.bfloat16)})["w"][:2] == [[64, 32], "bfloat16"]


def test_a_model_with_a_frozen_layer_checkpoints_what_trains_and_buffers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    model[0].requires_grad_(False)
    x, y = classification_data(n=96)
    Trainer(epochs=1, batch_size=16, track=False, accelerator="cpu", checkpoint_dir=tmp_path).fit(
        model, (x, y), loss_fn=nn.CrossEntropyLoss())
    payload = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert set(payload["model"]) == {"1.weight", "1.bias", "1.running_mean", "1.running_var",
                                     "1.num_batches_tracked", "3.weight", "3.bias"}
    assert set(payload["frozen"]) == {"0.weight", "0.bias"}
    assert torch.equal(payload["model"]["1.running_mean"], model[1].running_mean)  # the statistics moved


def test_continue_goes_on_from_the_adapters_exactly():
    straight = lora_llama()
    fit(straight, epochs=2)
    model = lora_llama()
    first = fit(model, epochs=1)
    Trainer(batch_size=16, lr=1e-2, log_every=2, track=False, accelerator="cpu", epochs=1).fit(
        model, CountingText(), continue_from=first)
    assert_equal_states(trainable_state(model), trainable_state(straight))


def test_best_checkpoints_hold_the_adapters_and_restore_best_loads_them(tmp_path):
    model = lora_llama()
    base = frozen_state(model)
    result = Trainer(batch_size=16, lr=1e-2, track=False, accelerator="cpu", epochs=3, save_top_k=1,
                     restore_best=True, checkpoint_dir=tmp_path).fit(model, CountingText(),
                                                                     CountingText(n=32, seed=9))
    assert result.restored_best
    best = load_checkpoint(result.best_checkpoint)
    assert best["frozen"] is not None and best["version"] == 3
    for name, value in trainable_state(model).items():
        assert torch.equal(value, best["model"][name]), name
    assert_equal_states(frozen_state(model), base)


class NanAdapterAt:
    """Poisons an adapter weight after a given step: the next step's loss is NaN."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, state):
        if state.step == self.step:
            with torch.no_grad():
                next(p for name, p in state.model.named_parameters() if "lora_B" in name).fill_(float("nan"))


def test_a_nan_puts_the_last_good_adapters_back(tmp_path):
    model = lora_llama()
    base = frozen_state(model)
    with pytest.raises(GpunbError, match="last good checkpoint, step 4"):
        fit(model, epochs=3, checkpoint_dir=tmp_path, checkpoint_every=4, callbacks=[NanAdapterAt(6)])
    good = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert good["step"] == 4
    for name, value in trainable_state(model).items():
        assert torch.equal(value, good["model"][name]), name
    assert_equal_states(frozen_state(model), base)


def test_two_processes_save_what_trains_and_resume_exactly(tmp_path):
    options = dict(devices=2, batch_size=8)
    straight = lora_llama()
    fit(straight, epochs=2, **options)
    fit(lora_llama(), epochs=1, checkpoint_dir=tmp_path, **options)
    payload = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert payload["frozen"] is not None and payload["world_size"] == 2
    assert not any("base_layer" in name for name in payload["model"])
    resumed = lora_llama(seed=7)
    result = fit(resumed, epochs=2, checkpoint_dir=tmp_path, resume="last", **options)
    assert result.steps == 8
    assert_equal_states(trainable_state(resumed), trainable_state(straight))


# --- merging the adapters ------------------------------------------------------------------------

def test_merge_adapters_gives_the_base_model_with_the_same_outputs():
    kept, merged = lora_llama(), lora_llama()
    fit(kept, epochs=1)
    result = fit(merged, epochs=1, merge_adapters=True)
    base = result.model
    assert isinstance(base, transformers.LlamaForCausalLM)
    assert not any("lora" in name for name, _ in base.named_parameters())
    assert result.continue_state is None  # the adapters it went on from are gone
    assert "adapters merged into result.model" in repr(result)
    ids = CountingText(n=8, seed=5).ids
    kept.eval(), base.eval()
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, kept(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.predict(CountingText(n=8, seed=5))["logits"], kept(input_ids=ids).logits.detach(),
                               rtol=1e-5, atol=1e-5)


def test_an_interrupted_fit_keeps_its_adapters_and_says_how_to_merge_them():
    model = lora_llama()
    with pytest.warns(RuntimeWarning, match=r"interrupted, so the adapters stay separate .*model.merge_and_unload"):
        result = fit(model, epochs=2, merge_adapters=True, callbacks=[InterruptAt(2)])
    assert result.interrupted and result.model is None
    assert result.continue_state is not None  # it can go on
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_merge_adapters_on_a_model_without_adapters_is_refused_before_any_work(tmp_path):
    with pytest.raises(GpunbError, match=r"(?s)has no adapters .*HINT: wrap the model first"):
        fit(tiny_llama(), merge_adapters=True, checkpoint_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_gputrain_trains_a_peft_model_and_merges_its_adapters(capsys):
    import IPython
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython() or IPython.get_ipython()
    shell.run_line_magic("load_ext", "gpunb")
    shell.user_ns.clear()
    shell.user_ns.update(lora_llama=lora_llama, CountingText=CountingText)
    try:
        shell.run_cell_magic("gputrain", "--epochs 1 --batch-size 16 --accelerator cpu --no-track --merge-adapters",
                             "model = lora_llama()\ntrain_data = CountingText()")
        result, model = shell.user_ns["gputrain_result"], shell.user_ns["model"]
        assert result.steps == 4 and result.config["merge_adapters"]
        assert isinstance(result.model, transformers.LlamaForCausalLM)
        assert model.base_model.model is result.model  # the notebook's peft model wraps the merged base
        assert "adapters merged into result.model" in capsys.readouterr().out
    finally:
        shell.user_ns.clear()


def test_the_magic_option_reaches_the_config():
    from IPython.core.magic_arguments import parse_argstring

    from gpunb.notebook.magics import GpuMagics, _config

    assert _config(parse_argstring(GpuMagics.gputrain, "--merge-adapters")).merge_adapters
    assert not _config(parse_argstring(GpuMagics.gputrain, "")).merge_adapters


# --- quantized base weights (QLoRA) ----------------------------------------------------------------

def fake_quantized_llama():
    """A tiny Llama whose projections are of a class named like bitsandbytes' 4-bit layer."""
    fake = type("Linear4bit", (nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    model = tiny_llama()
    for layer in model.model.layers:
        old = layer.self_attn.o_proj
        layer.self_attn.o_proj = fake(old.in_features, old.out_features, bias=False)
    return model


def test_quantized_layers_without_bitsandbytes_are_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # as if it were not installed
    model = fake_quantized_llama()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(GpunbError) as error:
        fit(model, checkpoint_dir=tmp_path)
    message = str(error.value)
    assert "weights quantized by bitsandbytes (2 Linear4bit)" in message
    assert "cannot be imported here" in message
    assert 'HINT: install it, `pip install "gpunb[llm]"` (or `pip install bitsandbytes`)' in message
    assert not list(tmp_path.iterdir())  # refused before any work
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def qlora_llama(device="cpu", seed=0):
    """A tiny Llama with bitsandbytes 4-bit (NF4) projections, LoRA on q and v: QLoRA."""
    bnb = pytest.importorskip("bitsandbytes")
    model = tiny_llama()
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            old = getattr(layer.self_attn, name)
            quantized = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False,
                                          compute_dtype=torch.float32, quant_type="nf4")
            quantized.weight = bnb.nn.Params4bit(old.weight.data.clone(), requires_grad=False, quant_type="nf4")
            setattr(layer.self_attn, name, quantized)
    model.to(device)  # quantizes
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                             task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def qlora_trains_and_resumes(tmp_path, accelerator):
    try:
        model = qlora_llama(accelerator)
    except (RuntimeError, NotImplementedError) as error:  # a bitsandbytes without this device's backend
        pytest.skip(f"bitsandbytes cannot quantize on {accelerator} here: {error}")
    assert "Linear4bit" in {type(m).__name__ for m in model.modules()}
    base = frozen_state(model)
    straight = fit(model, epochs=3, accelerator=accelerator)
    assert straight.history[-1]["loss"] < straight.history[0]["loss"]
    assert_equal_states(frozen_state(model), base)  # the quantized base has not moved
    # the summary counts the weights a 4-bit parameter packs, as peft does
    assert straight.frozen_params == model.get_nb_trainable_parameters()[1] - straight.trainable_params
    fit(qlora_llama(accelerator), epochs=2, checkpoint_dir=tmp_path, accelerator=accelerator)
    payload = load_checkpoint(list_checkpoints(tmp_path)[-1])
    assert any(name.endswith("weight.quant_state.bitsandbytes__nf4") for name in payload["frozen"])
    resumed = qlora_llama(accelerator, seed=7)
    fit(resumed, epochs=3, checkpoint_dir=tmp_path, resume="last", accelerator=accelerator)
    assert_equal_states(trainable_state(resumed), trainable_state(model))


def test_qlora_trains_and_resumes_exactly_where_bitsandbytes_runs_on_the_cpu(tmp_path):
    qlora_trains_and_resumes(tmp_path, "cpu")


@pytest.mark.cuda
def test_qlora_trains_and_resumes_exactly_on_cuda(tmp_path):
    qlora_trains_and_resumes(tmp_path, "cuda")
