"""GPU-only behaviour: prefetcher streams and memory, stream order under forced races, GPU-resident
data, GradScaler, bf16, and no host sync between logs."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer

pytestmark = pytest.mark.cuda


def test_prefetcher_creates_one_stream_and_frees_memory_between_epochs():
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    device = torch.device("cuda")
    prefetch = CudaPrefetcher(device)
    stream = prefetch.stream
    batches = [(torch.randn(256, 1024), torch.randn(256)) for _ in range(8)]
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    peaks = []
    for _epoch in range(3):
        for x, y in prefetch(iter(batches)):
            # "cuda" names the current device; a tensor's device always carries its index
            assert x.device.type == "cuda" and x.device.index == torch.cuda.current_device()
            (x.sum() + y.sum()).item()
        del x, y  # the loop's names would keep the last batch alive
        torch.cuda.synchronize()
        peaks.append(torch.cuda.memory_allocated())
    assert prefetch.stream is stream
    assert peaks[-1] == peaks[0] == baseline  # nothing kept alive across epochs
    assert list(prefetch(iter([]))) == []


def test_prefetched_values_are_exactly_the_host_values():
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    batches = [(torch.full((1024, 256), float(i)),) for i in range(16)]
    got = [b[0][0, 0].item() for b in CudaPrefetcher(torch.device("cuda"))(iter(batches))]
    assert got == [float(i) for i in range(16)]


def test_small_tensor_data_lives_on_the_gpu():
    from gpunb.runtime.feed.feeds import build_feed

    x, y = classification_data(n=256)
    feed = build_feed((x, y), batch_size=32, device=torch.device("cuda"),
                      config=__import__("gpunb").TrainConfig())
    assert feed.tensors[0].is_cuda and feed.prefetch is None
    batch = next(feed.epoch(0))
    assert batch[0].is_cuda and batch[0].shape == (32, 10)


def test_auto_precision_on_this_gpu_trains():
    x, y = classification_data(n=1024)
    # 20 epochs of 16 steps: the same run in fp32 on the CPU ends at val_acc 0.959 (0.687 after 3)
    result = Trainer(epochs=20, batch_size=64, track=False).fit(mlp(), (x, y), (x, y),
                                                                loss_fn=nn.CrossEntropyLoss())
    expected = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    assert result.precision == expected and result.peak_memory_mb > 0
    assert result.final_metrics["val_acc"] > 0.9


def test_grad_scaler_on_gpu_skips_inf_steps():
    model = mlp()
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    model[0].weight.register_hook(poison)
    result = Trainer(epochs=1, batch_size=16, precision="16-mixed", track=False).fit(
        model, classification_data(n=128), loss_fn=nn.CrossEntropyLoss())
    assert result.skipped_steps == 1


def test_dataloader_path_uses_pinned_memory_and_prefetcher():
    from torch.utils.data import Dataset

    class Pairs(Dataset):
        def __init__(self):
            self.x, self.y = classification_data(n=512)

        def __len__(self):
            return 512

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    from gpunb.config import TrainConfig
    from gpunb.runtime.feed.feeds import LoaderFeed, build_feed
    from gpunb.runtime.feed.inputs import adapt_data

    device = torch.device("cuda", torch.cuda.current_device())
    feed = build_feed(adapt_data(Pairs(), "train_data"), batch_size=64, device=device,
                      config=TrainConfig(num_workers=2))  # the feed fit builds for this data
    assert isinstance(feed, LoaderFeed) and feed.loader.pin_memory and feed.prefetch is not None
    first = next(iter(feed.epoch(0)))
    assert first[0].device == device and first[0].shape == (64, 10)
    del feed, first  # the loader's workers go with it

    result = Trainer(epochs=2, batch_size=64, num_workers=2, track=False).fit(
        mlp(), Pairs(), loss_fn=nn.CrossEntropyLoss())
    assert result.samples == 1024 and result.device.startswith("cuda")


def test_a_gpu_run_reports_mfu_against_this_gpus_peak():
    from gpunb.runtime.probes.peak_flops import device_peak_tflops

    x, y = classification_data(n=1024)
    result = Trainer(epochs=1, batch_size=64, track=False).fit(mlp(), (x, y), loss_fn=nn.CrossEntropyLoss())
    peak = device_peak_tflops(torch.device("cuda", torch.cuda.current_device()), result.precision)
    assert result.peak_tflops == peak and result.flops_per_step > 0 and result.achieved_tflops > 0
    if peak is None:  # a GPU not in the table
        assert result.mfu is None
    else:
        assert 0 < result.mfu < 1 and result.mfu == pytest.approx(result.achieved_tflops / peak)


# --------------------------------------------------------------------------- device transforms


def uint8_images(n=512, size=32):
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g),
            torch.randint(0, 10, (n,), generator=g))


def augmentations():
    from gpunb.runtime.feed.transforms import Normalize, RandomCrop, RandomFlip

    return (RandomCrop(4), RandomFlip(), Normalize([127.0] * 3, [64.0] * 3))


def augmented_feed(data, **options):
    from gpunb import TrainConfig
    from gpunb.runtime.feed.feeds import build_feed

    config = TrainConfig(transforms=augmentations(), num_workers=0, **options)
    return build_feed(data, batch_size=64, device=torch.device("cuda"), config=config)


def on_host(batches):
    return [tuple(t.cpu() for t in batch) for batch in batches]


def test_transforms_ahead_on_the_side_stream_give_the_inline_values():
    from torch.utils.data import TensorDataset

    x, y = uint8_images()
    resident = augmented_feed((x, y))  # small: lives on the GPU; transforms: a side stream
    assert resident.tensors[0].is_cuda and resident.prefetch is not None
    ahead = on_host(resident.epoch(1))
    from_host = augmented_feed((x, y), gpu_resident=False)
    assert from_host.tensors[0].device.type == "cpu" and from_host.prefetch is not None
    copied = on_host(from_host.epoch(1))
    loaded = on_host(augmented_feed(TensorDataset(x, y)).epoch(1))
    resumed = on_host(resident.epoch(1, skip=3))
    resident.prefetch = None  # the inline path: transforms on the consumer stream
    inline = on_host(resident.epoch(1))
    assert len(inline) == 8 and inline[0][0].dtype == torch.float32
    for other in (ahead, copied, loaded):  # resident, host tensors, DataLoader: all ahead
        assert_same_batches(other, inline)
    assert_same_batches(resumed, inline[3:])


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_side_stream_transforms_keep_one_stream_and_free_their_memory_between_epochs():
    feed = augmented_feed(uint8_images())
    stream = feed.prefetch.stream
    peaks = []
    for epoch in range(3):
        for x, y in feed.epoch(epoch):
            assert x.is_cuda and x.dtype == torch.float32 and x.shape == (64, 3, 32, 32)
            (x.sum() + y.sum()).item()
        del x, y  # the loop's names would keep the last batch alive
        torch.cuda.synchronize()
        peaks.append(torch.cuda.memory_allocated())
    assert feed.prefetch.stream is stream
    assert peaks[0] == peaks[1] == peaks[2]  # nothing kept alive across epochs (Normalize's mean/std
    # copies and RandomCrop's sample numbers, made in the first epoch, stay)


def test_host_tensors_are_gathered_straight_into_pinned_memory(monkeypatch):
    from gpunb import TrainConfig
    from gpunb.runtime.feed.feeds import build_feed

    x, y = uint8_images()
    feed = build_feed((x, y), batch_size=64, device=torch.device("cuda"),
                      config=TrainConfig(gpu_resident=False, shuffle=False))
    assert feed.tensors[0].device.type == "cpu" and feed.prefetch is not None
    gathered = []
    gather = feed.prefetch.gather
    feed.prefetch.gather = lambda tensors, rows: gathered.append(gather(tensors, rows)) or gathered[-1]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda *a, **k: pytest.fail("pinned in a second pass"))
    batches = on_host(feed.epoch(0))
    assert len(gathered) == 8 and all(t.is_pinned() for batch in gathered for t in batch)
    assert torch.equal(torch.cat([b[0] for b in batches]), x) and torch.equal(torch.cat([b[1] for b in batches]), y)


def test_random_crop_on_the_gpu_takes_one_window_of_the_padded_sample():
    from gpunb.runtime.feed.transforms import RandomCrop

    x = uint8_images(n=200, size=6)[0].cuda()
    got = RandomCrop(2)(x).cpu()
    padded = torch.nn.functional.pad(x.cpu(), (2, 2, 2, 2))
    seen = set()
    for i in range(len(x)):
        windows = [(dy, dx) for dy in range(5) for dx in range(5)
                   if torch.equal(got[i], padded[i, :, dy:dy + 6, dx:dx + 6])]
        assert len(windows) == 1
        seen.update(windows)
    assert len(seen) == 25


def test_resident_data_without_transforms_is_gathered_inline():
    from gpunb import TrainConfig
    from gpunb.runtime.feed.feeds import build_feed

    plain = build_feed(uint8_images(), batch_size=64, device=torch.device("cuda"), config=TrainConfig())
    assert plain.tensors[0].is_cuda and plain.prefetch is None
    assert augmented_feed(uint8_images()).prefetch is not None


def small_convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Dropout(0.2), nn.Linear(256, 10))


def test_training_on_resident_uint8_images_with_transforms_records_its_data_wait():
    x, y = uint8_images()
    result = Trainer(epochs=2, batch_size=64, transforms=augmentations(), track=False).fit(
        small_convnet(), (x, y), loss_fn=nn.CrossEntropyLoss())
    assert result.steps == 16 and result.device.startswith("cuda")
    assert 0 < result.data_wait_s < result.wall_time_s
    assert all(row["loss"] == row["loss"] for row in result.history)  # finite, not NaN


def test_transforms_are_prepared_in_a_thread_that_ends_with_the_fit():
    import threading

    class Threads:
        seen = set()

        def on_step_end(self, state):
            self.seen.update(t.name for t in threading.enumerate())

    x, y = uint8_images()
    threads = Threads()
    Trainer(epochs=2, batch_size=64, transforms=augmentations(), track=False).fit(
        small_convnet(), (x, y), (x[:128], y[:128]), loss_fn=nn.CrossEntropyLoss(), callbacks=[threads])
    assert "gpunb-prefetch" in threads.seen
    assert not [t for t in threading.enumerate() if t.name == "gpunb-prefetch"]  # train's and validation's


def test_random_device_transforms_resume_bit_for_bit_on_the_gpu(tmp_path):
    from test_resume_exact import test_random_device_transforms_resume_mid_epoch_bit_for_bit as resume_test

    # eager: compile="auto" decides from the time left, which a resumed run sees otherwise
    resume_test(tmp_path, accelerator="cuda", deterministic=True, compile=False)


# --------------------------------------------------------------------------- stream order, forced
# A GPU sleep queued on one stream holds back what is queued after it on that stream only;
# work on another stream that does not wait for it runs at once (torch's streams do not
# synchronise with each other by themselves). Each test below queues such a sleep before
# a write, so that a missing wait reads the memory before it is written: wrong values,
# every time, rather than a rare race.

SLEEP_CYCLES = 50_000_000  # about 25-35 ms at an H100's or H200's clock: ages for a fill or a copy
SIZE = 1 << 18  # floats per test batch


def consumer_made(count):
    """Tensors the consumer (current) stream writes only after a sleep, as a loader running in
    the loop's thread (DataLoader with num_workers=0) makes GPU tensors."""
    for i in range(count):
        x = torch.full((SIZE,), -1.0, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        x.fill_(float(i))
        yield x


def side_made(i):
    """Batch i, written on the stream this runs on (the side stream) only after a sleep."""
    x = torch.full((SIZE,), -1.0, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    return x.fill_(float(i))


def filled_with(batches) -> list:
    """The one value each batch holds (None where its elements differ), read on the consumer stream."""
    return [b.min().item() if b.min().item() == b.max().item() else None for b in batches]


def test_the_side_stream_waits_for_what_the_consumer_stream_made_before_preparing_it():
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    prefetch = CudaPrefetcher(torch.device("cuda"))
    prepared = [batch.clone() for batch in prefetch(consumer_made(6), prepare=lambda x: x + 0)]
    assert filled_with(prepared) == [float(i) for i in range(6)]


def test_a_prefetch_thread_waits_for_what_the_consumer_stream_made_for_the_epoch():
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    def epoch() -> list:
        prefetch = CudaPrefetcher(torch.device("cuda"))
        rows = torch.full((6, SIZE), -1.0, device="cuda")  # as the epoch's order, made on the consumer stream
        torch.cuda._sleep(SLEEP_CYCLES)
        rows.copy_(torch.arange(6.0, device="cuda")[:, None].expand(6, SIZE))
        return filled_with([batch.clone() for batch in prefetch.in_thread(range(6), prepare=lambda i: rows[i] + 0)])

    # CUDA loads a kernel at its first launch (lazy loading), and the load waits for the work in
    # flight: the thread's first `+ 0` would wait for the sleep and hide a missing wait. Load them all.
    epoch()
    torch.cuda.synchronize()
    assert epoch() == [float(i) for i in range(6)]


@pytest.mark.parametrize("ahead", ["in the loop's thread", "in a thread"])
def test_the_consumer_stream_waits_for_each_prepared_batch(ahead):
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    prefetch = CudaPrefetcher(torch.device("cuda"))
    prepared = prefetch if ahead == "in the loop's thread" else prefetch.in_thread
    batches = prepared(range(6), side_made)
    read = [batch.clone() for batch in batches]  # queued at once on the consumer stream: no host wait
    assert filled_with(read) == [float(i) for i in range(6)]


def test_a_batch_in_use_on_the_consumer_stream_is_not_overwritten_by_a_later_one():
    """The consumer stream is still busy with a batch the loop has let go: its memory must not be
    handed to a batch prepared later (record_stream), or that batch's write lands in it first."""
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    prefetch = CudaPrefetcher(torch.device("cuda"))
    read = []
    for batch in prefetch.in_thread(range(8), lambda i: torch.full((SIZE,), float(i), device="cuda")):
        torch.cuda._sleep(SLEEP_CYCLES)  # a long step, before it reads the batch
        read.append(batch.clone())
    assert filled_with(read) == [float(i) for i in range(8)]


def numbered_rows(n=512, features=16):
    """Every value distinct, so a batch read before its copy landed cannot pass for the right one."""
    return (torch.arange(n * features, dtype=torch.float32).view(n, features) + 1, torch.arange(n))


def identity(x):
    """A device transform without a `generator` argument: its batches are prepared in the loop's thread."""
    return x


def slowed_copy(monkeypatch):
    """Each host batch's copy to the GPU queued behind a sleep on the side stream."""
    from gpunb.runtime.feed.prefetch import CudaPrefetcher

    copy = CudaPrefetcher.copy

    def slowed(self, host_batch):
        torch.cuda._sleep(SLEEP_CYCLES)
        return copy(self, host_batch)

    monkeypatch.setattr(CudaPrefetcher, "copy", slowed)


class Rows(torch.utils.data.Dataset):
    """Tensors `(x, y)` read one sample at a time, through a DataLoader."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


@pytest.mark.parametrize("source, options", [
    ("tensors", dict(gpu_resident=False)),  # copied in a thread (event per batch)
    ("tensors", dict(gpu_resident=False, transforms=(identity,))),  # copied in the loop's thread
    ("dataset", dict(num_workers=0)),  # DataLoader in this process: the loop's thread
    ("dataset", dict(num_workers=2)),  # workers: copied in a thread
])
def test_each_prepared_batch_holds_its_rows_when_its_copy_is_slow(source, options, monkeypatch):
    from gpunb import TrainConfig
    from gpunb.runtime.feed.feeds import build_feed
    from gpunb.runtime.feed.inputs import adapt_data

    slowed_copy(monkeypatch)
    x, y = numbered_rows()
    data = (x, y) if source == "tensors" else adapt_data(Rows(x, y), "train_data")
    feed = build_feed(data, batch_size=64, device=torch.device("cuda"),
                      config=TrainConfig(shuffle=False, **options))
    assert feed.prefetch is not None
    expected_x, expected_y = x.cuda(), y.cuda()
    torch.cuda.synchronize()
    matches = []
    for b, batch in enumerate(feed.epoch(0)):
        rows = slice(64 * b, 64 * (b + 1))
        # queued on the consumer stream as a step would be, read after the epoch
        matches.append(torch.stack([(batch[0] == expected_x[rows]).all(), (batch[1] == expected_y[rows]).all()]))
    assert len(matches) == 8
    assert torch.stack(matches).all(dim=1).tolist() == [True] * 8


@pytest.mark.parametrize("transforms", [(), (identity,)], ids=["in a thread", "in the loop's thread"])
def test_training_from_host_tensors_with_slow_copies_ends_as_from_resident_ones(transforms, monkeypatch):
    x, y = classification_data(n=512)

    def trained(**options):
        torch.manual_seed(0)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        result = Trainer(epochs=2, batch_size=64, precision="32", compile=False, track=False, log_every=1,
                         transforms=transforms, **options).fit(model, (x, y), optimizer=optimizer,
                                                               loss_fn=nn.CrossEntropyLoss())
        return model, [row["loss"] for row in result.history]

    resident, resident_losses = trained(gpu_resident=True)
    slowed_copy(monkeypatch)
    copied, copied_losses = trained(gpu_resident=False)
    assert copied_losses == pytest.approx(resident_losses, rel=1e-4)
    for a, b in zip(resident.parameters(), copied.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- no sync per step


class NoSyncBetweenLogs:
    """Makes every synchronising CUDA call an error (`torch.cuda.set_sync_debug_mode`) from the
    first step's end (set-up and the first step's lazy initialisation may sync) to the last
    step's (the fit's final log then reads the losses, its one sync). In between: the data of
    each step, forward, backward, the optimizer, and every callback's per-step hook."""

    def __init__(self):
        self.checked_steps = 0

    def on_step_end(self, state):
        if state.step == 1:
            torch.cuda.set_sync_debug_mode("error")
            return
        self.checked_steps += 1
        if state.step == state.total_steps:
            torch.cuda.set_sync_debug_mode(0)

    def on_exception(self, state, error):  # the error path may sync: not what is checked
        torch.cuda.set_sync_debug_mode(0)


def fit_without_syncs(model, data, callbacks=(), **options):
    """One epoch under NoSyncBetweenLogs, logged only at its end; every step but the first was checked."""
    check = NoSyncBetweenLogs()
    settings = dict(epochs=1, batch_size=64, log_every=10_000, compile=False)  # tracked: the default
    settings.update(options)
    try:
        result = Trainer(**settings).fit(model, data, loss_fn=nn.CrossEntropyLoss(), callbacks=[check, *callbacks])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert result.steps == result.history[-1]["step"] > 2 and len(result.history) == 1
    assert check.checked_steps == result.steps - 1
    return result


@pytest.mark.parametrize("data, options", [
    ("tensors", {}),  # resident on the GPU, gathered inline
    ("tensors", dict(clip_grad_norm=1.0, lr_schedule="cosine", grad_accum=2)),
    ("tensors", dict(gpu_resident=False)),  # from host memory, prefetched in a thread
    ("tensors", dict(gpu_resident=False, transforms=(identity,))),  # prefetched in the loop's thread
    ("dataset", dict(num_workers=0)),  # DataLoader in this process, prefetched in the loop's thread
    ("dataset", dict(num_workers=2)),
])
def test_training_steps_do_not_sync_with_the_gpu_between_logs(data, options):
    x, y = classification_data(n=512)
    result = fit_without_syncs(mlp(), (x, y) if data == "tensors" else Rows(x, y), **options)
    assert result.device.startswith("cuda")


def test_steps_with_device_transforms_do_not_sync_with_the_gpu_between_logs():
    fit_without_syncs(small_convnet(), uint8_images(), transforms=augmentations())


def test_a_sync_in_a_step_is_caught_by_the_check():
    class ReadsTheLoss:
        def on_step_end(self, state):
            float(next(state.model.parameters()).sum())  # as a per-step log of a value would

    with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        fit_without_syncs(mlp(), classification_data(n=512), callbacks=[ReadsTheLoss()])
    assert torch.cuda.get_sync_debug_mode() == 0


@pytest.mark.cuda
def test_tensors_already_on_the_gpu_train_and_validate():
    """(x.cuda(), y.cuda()): the batch checked before training is gathered where the tensors are."""
    x, y = classification_data(n=64)
    result = Trainer(epochs=1, batch_size=16, track=False, compile=False).fit(
        mlp(), (x.cuda(), y.cuda()), (x[:32].cuda(), y[:32].cuda()), loss_fn=nn.CrossEntropyLoss())
    assert result.steps == 4 and result.device.startswith("cuda") and "val_loss" in result.final_metrics
