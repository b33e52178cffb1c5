"""GPU-only behaviour: prefetcher streams and memory, GPU-resident data, GradScaler, bf16."""

import pytest
import torch
from conftest import classification_data, mlp
from torch import nn

from gpunb import Trainer

pytestmark = pytest.mark.cuda


def test_prefetcher_creates_one_stream_and_frees_memory_between_epochs():
    from gpunb.runtime.prefetch import CudaPrefetcher

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
    from gpunb.runtime.prefetch import CudaPrefetcher

    batches = [(torch.full((1024, 256), float(i)),) for i in range(16)]
    got = [b[0][0, 0].item() for b in CudaPrefetcher(torch.device("cuda"))(iter(batches))]
    assert got == [float(i) for i in range(16)]


def test_small_tensor_data_lives_on_the_gpu():
    from gpunb.runtime.data import build_feed

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
    from gpunb.runtime.data import LoaderFeed, build_feed
    from gpunb.runtime.inputs import adapt_data

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
    from gpunb.runtime.peak_flops import device_peak_tflops

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
    from gpunb.runtime.transforms import Normalize, RandomCrop, RandomFlip

    return (RandomCrop(4), RandomFlip(), Normalize([127.0] * 3, [64.0] * 3))


def augmented_feed(data, **options):
    from gpunb import TrainConfig
    from gpunb.runtime.data import build_feed

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
    from gpunb.runtime.data import build_feed

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
    from gpunb.runtime.transforms import RandomCrop

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
    from gpunb.runtime.data import build_feed

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
