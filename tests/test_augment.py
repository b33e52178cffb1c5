"""Device transforms: per-batch randomness, and their place on the prefetcher's side stream.

The stream tests fake torch.cuda's stream API so that the order of the side stream's
work, the stream waits and the record_stream calls can be checked without a GPU.
"""

import pickle
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpunb import TrainConfig
from gpunb.runtime.feed.augmenter import Augmenter
from gpunb.runtime.feed.feeds import EpochOrder, LoaderFeed, TensorFeed, build_feed
from gpunb.runtime.feed.prefetch import CudaPrefetcher
from gpunb.runtime.feed.transforms import Normalize, RandomCrop, RandomFlip

CPU = torch.device("cpu")


def images(n=40):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(n)


def augmentations():
    return [RandomCrop(2), RandomFlip(), Normalize([0.5] * 3, [0.25] * 3)]


def test_a_resumed_epoch_sees_the_same_augmented_batches():
    feed = build_feed(images(), batch_size=8, device=CPU, config=TrainConfig(transforms=augmentations()))
    straight = list(feed.epoch(3))
    resumed = list(feed.epoch(3, skip=2))
    assert len(resumed) == 3
    for a, b in zip(straight[2:], resumed):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(straight[0][0], list(feed.epoch(4))[0][0])  # another epoch, other draws


def test_seeded_transforms_neither_read_nor_move_the_global_rng():
    augment = Augmenter([RandomFlip(), RandomCrop(2)], seed=5, device=CPU)
    x = images()[0][:16].float()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = augment((x,), epoch=1, position=2)[0]
    assert torch.equal(torch.get_rng_state(), before)  # Dropout's draws stay where they were
    torch.rand(1000)  # the global RNG elsewhere: another time of preparation
    assert torch.equal(augment((x,), epoch=1, position=2)[0], first)
    assert not torch.equal(augment((x,), epoch=1, position=3)[0], first)
    assert not torch.equal(Augmenter([RandomFlip(), RandomCrop(2)], 6, CPU)((x,), 1, 2)[0], first)


def test_seeded_transforms_draw_what_the_global_rng_seeded_per_batch_would():
    """gpunb's transforms draw from the generator they are given; seeded per batch, it gives the
    draws the global RNGs seeded alike gave (and still give callables that take no generator)."""
    from gpunb.runtime.feed.augmenter import batch_rng, transform_seed

    x = images()[0][:16].float()
    with batch_rng(transform_seed(5, 1, 2), CPU):
        expected = RandomCrop(2)(RandomFlip()(x))
    assert torch.equal(Augmenter([RandomFlip(), RandomCrop(2)], seed=5, device=CPU)((x,), 1, 2)[0], expected)
    no_generator = [lambda t: RandomFlip()(t), lambda t: RandomCrop(2)(t)]
    assert torch.equal(Augmenter(no_generator, seed=5, device=CPU)((x,), 1, 2)[0], expected)


def test_without_a_seed_the_generator_is_seeded_once_from_the_global_rng():
    x = torch.arange(64.0).view(16, 1, 1, 4)
    torch.manual_seed(3)
    augment = Augmenter([RandomFlip()], seed=None, device=CPU)
    before = torch.get_rng_state()
    first, second = augment(x, epoch=0, position=0), augment(x, epoch=0, position=1)
    assert torch.equal(torch.get_rng_state(), before)  # drawn from the generator, not the global RNG
    assert not torch.equal(first, second)  # one stream of draws, batch after batch
    torch.manual_seed(3)
    assert torch.equal(Augmenter([RandomFlip()], seed=None, device=CPU)(x, epoch=0, position=0), first)


def test_without_a_seed_a_callable_without_a_generator_draws_from_the_global_rng():
    augment = Augmenter([lambda t: RandomFlip()(t)], seed=None, device=CPU)
    x = torch.arange(64.0).view(16, 1, 1, 4)
    torch.manual_seed(3)
    got = augment(x, epoch=0, position=0)
    torch.manual_seed(3)
    assert torch.equal(got, RandomFlip()(x))


def test_only_transforms_that_take_a_generator_keep_off_the_global_rng():
    from gpunb.runtime.feed.augmenter import takes_generator

    def own(x, generator=None):
        return x

    def keyword_only(x, *, generator):
        return x

    assert takes_generator(RandomCrop(2)) and takes_generator(Normalize([0.0], [1.0])) and takes_generator(own)
    assert takes_generator(keyword_only)
    assert not takes_generator(lambda x: x) and not takes_generator(lambda x, **kwargs: x)
    assert not takes_generator(torch.flip)  # no signature to read
    assert Augmenter([RandomFlip(), own], 0, CPU).own_rng and Augmenter([], 0, CPU).own_rng
    assert not Augmenter([RandomFlip(), lambda x: x], 0, CPU).own_rng


def test_normalize_copies_mean_and_std_once_and_not_when_pickled():
    normalize = Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
    x = torch.full((2, 3, 4, 4), 1.0)
    assert torch.equal(normalize(x), torch.full((2, 3, 4, 4), 2.0))
    kept = normalize._on[CPU, 4]
    normalize(x)
    assert normalize._on[CPU, 4] is kept and len(normalize._on) == 1
    assert pickle.loads(pickle.dumps(normalize))._on == {}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.float64])
def test_normalize_gives_float32_x_minus_mean_over_std(dtype):
    mean, std = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
    x = images(6)[0].to(dtype)
    expected = (x.double() - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)) / \
        torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    got = Normalize(mean, std)(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_random_crop_takes_one_window_of_the_zero_padded_batch_per_sample():
    x = torch.arange(1, 1 + 300 * 2 * 5 * 5, dtype=torch.float32).view(300, 2, 5, 5)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    torch.manual_seed(0)
    got = RandomCrop(2)(x)
    seen = set()
    for i in range(len(x)):
        offsets = [(dy, dx) for dy in range(5) for dx in range(5)
                   if torch.equal(got[i], padded[i, :, dy:dy + 5, dx:dx + 5])]
        assert len(offsets) == 1  # one window, of this sample, all its channels alike
        seen.update(offsets)
    assert len(seen) == 25  # every offset from (0, 0) to (2p, 2p) drawn
    crop = RandomCrop(2)
    crop(x[:8])
    assert crop._samples and len(pickle.loads(pickle.dumps(crop))._samples) == 0  # its device tensors stay here


def test_the_transforms_launch_few_ops_per_batch():
    # On a host-bound GPU step each op's launch is time the step waits for: RandomCrop picks each
    # sample's window of a view of all windows with one index op, and Normalize is one op.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = images(16)[0]
    crop, normalize = RandomCrop(2), Normalize([0.5] * 3, [0.25] * 3)
    normalize(crop(x))  # the first batch of this shape makes the fixed tensors
    with Ops() as crop_ops:
        cropped = crop(x)
    with Ops() as normalize_ops:
        normalize(cropped)
    views = ("unfold", "unbind", "slice", "view", "select")
    assert [n for n in crop_ops.names if n not in views] == ["constant_pad_nd", "randint", "index"]
    assert normalize_ops.names == ["addcmul"]


class FakeStreams:
    """torch.cuda's Stream, Event, current_stream, stream() and Tensor.record_stream, logging to
    `log`; the current stream is per thread, as CUDA's is."""

    def __init__(self, monkeypatch):
        self.log = []
        self.consumer = FakeStream("consumer", self.log)
        self._local = threading.local()
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("side", self.log))
        monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(self.log))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda tensor, stream: self.log.append(("record", id(tensor), stream.name)))
        # no pinned memory without a GPU: host rows are gathered into pageable memory
        monkeypatch.setattr(CudaPrefetcher, "gather",
                            lambda prefetcher, tensors, rows: tuple(t.index_select(0, rows) for t in tensors))

    @property
    def current(self):
        return getattr(self._local, "stream", self.consumer)

    @current.setter
    def current(self, stream):
        self._local.stream = stream

    def stream(self, stream):
        streams = self

        class Context:
            def __enter__(self):
                self.outer, streams.current = streams.current, stream

            def __exit__(self, *exc):
                streams.current = self.outer

        return Context()

    def transform(self, x):
        """A transform that logs the stream it runs on and the batch it sees (its first value)."""
        self.log.append(("transform", self.current.name, int(x.flatten()[0])))
        return x * 10

    def own_rng_transform(self, x, generator=None):
        """The same, taking a generator (so drawing from no global RNG), and logging its thread."""
        self.log.append(("thread", threading.current_thread().name, int(x.flatten()[0])))
        return self.transform(x)


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event):
        self.log.append(("wait event", self.name, id(event)))


class FakeEvent:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("event", stream.name, id(self)))


def consume(streams, batches):
    """Iterate like the training loop, logging each batch as it is used."""
    seen = []
    for x, y in batches:
        streams.log.append(("use", int(x.flatten()[0]) // 10))
        seen.append((x, y))
    return seen


def assert_prepared_ahead_on_the_side_stream(log, seen, first, n):
    """Batches first..first+n-1 (batch i holds the value i) were each transformed on the side
    stream after it waited on the consumer, one batch ahead of their use, and handed over with
    a consumer wait and a record_stream of exactly the tensors the loop received."""
    batches = range(first, first + n)
    assert [e for e in log if e[0] == "transform"] == [("transform", "side", i) for i in batches]
    assert len(seen) == n
    for i, (x, y) in zip(batches, seen):
        use = log.index(("use", i))
        done = log.index(("transform", "side", i))
        assert log[done - 1] == ("wait", "side", "consumer")  # never overwrites what a step still reads
        if i + 1 < first + n:  # the next batch is prepared before this one is used
            assert log.index(("transform", "side", i + 1)) < use
        between = log[done:use]
        assert ("wait", "consumer", "side") in between  # the step waits for its batch
        for tensor in (x, y):  # the tensors handed over are the transformed ones, kept for the step
            assert ("record", id(tensor), "consumer") in between
        assert int(x.flatten()[0]) == 10 * i  # transformed once


def test_host_tensors_are_copied_and_transformed_on_the_side_stream(monkeypatch):
    streams = FakeStreams(monkeypatch)
    x = torch.arange(5).view(5, 1).repeat(1, 3)  # batch of one: row i is all i
    feed = TensorFeed((x, torch.arange(5)), 1, EpochOrder(5, False, 0), torch.device("cuda"), False,
                      Augmenter([streams.transform], 0, CPU))
    copies = []
    feed.prefetch.copy = lambda batch: copies.append(streams.current.name) or batch  # no GPU to copy to
    seen = consume(streams, feed.epoch(0))
    assert copies == ["side"] * 5
    assert_prepared_ahead_on_the_side_stream(streams.log, seen, 0, 5)


def test_batches_whose_transforms_take_a_generator_are_prepared_in_a_thread(monkeypatch):
    """Gathered, copied and transformed in the producer thread on the side stream, handed over
    in order, each with an event the consumer stream waits on and its tensors recorded there;
    the thread ends with the epoch."""
    streams = FakeStreams(monkeypatch)
    x = torch.arange(6).view(6, 1).repeat(1, 3)  # batch of one: row i is all i
    feed = TensorFeed((x, torch.arange(6)), 1, EpochOrder(6, False, 0), torch.device("cuda"), False,
                      Augmenter([streams.own_rng_transform], 0, CPU))
    feed.prefetch.copy = lambda batch: streams.log.append(("copy", threading.current_thread().name)) or batch
    seen = consume(streams, feed.epoch(0, skip=1))
    log = streams.log
    assert [int(x.flatten()[0]) for x, _ in seen] == [10, 20, 30, 40, 50]
    assert {e[1] for e in log if e[0] in ("thread", "copy")} == {"gpunb-prefetch"}
    assert [e for e in log if e[0] == "transform"] == [("transform", "side", i) for i in range(1, 6)]
    assert log.index(("wait", "side", "consumer")) < log.index(("copy", "gpunb-prefetch"))  # the order is there
    for i, (x, y) in zip(range(1, 6), seen):
        done = log.index(("transform", "side", i))
        event = next(e for e in log[done:] if e[0] == "event")  # the other thread logs in between
        assert event[1] == "side"  # recorded after the batch's work
        use = log.index(("use", i))
        assert log.index(("wait event", "consumer", event[2])) < use
        for tensor in (x, y):
            assert log.index(("record", id(tensor), "consumer")) < use
    assert not [t for t in threading.enumerate() if t.name == "gpunb-prefetch"]


def test_a_loop_that_stops_early_stops_the_producer_thread(monkeypatch):
    from gpunb.runtime.feed.feeds import closing

    streams = FakeStreams(monkeypatch)
    feed = TensorFeed((torch.arange(100).view(100, 1), torch.arange(100)), 1, EpochOrder(100, False, 0),
                      torch.device("cuda"), False, Augmenter([streams.own_rng_transform], 0, CPU))
    feed.prefetch.copy = lambda batch: batch
    with closing(feed.epoch(0)) as batches:
        for position, _ in enumerate(batches):
            if position == 2:
                break  # as the loop does at max_steps, or on an interrupt
    assert not [t for t in threading.enumerate() if t.name == "gpunb-prefetch"]
    assert len([e for e in streams.log if e[0] == "transform"]) <= 5  # the one in use and two ahead, at most


def test_an_error_in_the_producer_thread_is_raised_in_the_loop(monkeypatch):
    streams = FakeStreams(monkeypatch)

    def failing(x, generator=None):
        if int(x.flatten()[0]) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (in a transform)")
        return x

    feed = TensorFeed((torch.arange(5).view(5, 1), torch.arange(5)), 1, EpochOrder(5, False, 0),
                      torch.device("cuda"), False, Augmenter([failing], 0, CPU))
    feed.prefetch.copy = lambda batch: batch
    got = []
    with pytest.raises(torch.OutOfMemoryError, match="in a transform"):  # the type OOM recovery looks for
        for x, _ in feed.epoch(0):
            got.append(int(x))
    assert got == [0, 1]  # the batches before it arrived
    assert not [t for t in threading.enumerate() if t.name == "gpunb-prefetch"]
    assert streams.log


def test_transforms_that_draw_from_the_global_rng_stay_in_the_loops_thread(monkeypatch):
    streams = FakeStreams(monkeypatch)
    x = torch.arange(4).view(4, 1)
    feed = TensorFeed((x, torch.arange(4)), 1, EpochOrder(4, False, 0), torch.device("cuda"), False,
                      Augmenter([lambda t: streams.own_rng_transform(t)], 0, CPU))  # the lambda takes none
    feed.prefetch.copy = lambda batch: batch
    assert len(list(feed.epoch(0))) == 4
    assert {e[1] for e in streams.log if e[0] == "thread"} == {threading.current_thread().name}


def test_loader_batches_are_copied_and_transformed_on_the_side_stream(monkeypatch):
    streams = FakeStreams(monkeypatch)
    loader = DataLoader(TensorDataset(torch.arange(6).view(6, 1), torch.arange(6)), batch_size=1)
    positions = []

    def augment(batch, epoch, position):
        positions.append((epoch, position))
        return (streams.transform(batch[0]), batch[1])

    feed = LoaderFeed(loader, torch.device("cuda"), augment)
    feed.prefetch.copy = lambda batch: batch
    seen = consume(streams, feed.epoch(2, skip=2))
    assert positions == [(2, 2), (2, 3), (2, 4), (2, 5)]  # a resumed epoch's batches keep their seeds
    assert_prepared_ahead_on_the_side_stream(streams.log, seen, 2, 4)


def test_an_empty_feed_yields_nothing_on_the_side_stream(monkeypatch):
    streams = FakeStreams(monkeypatch)
    feed = TensorFeed((torch.zeros(0, 3), torch.zeros(0)), 4, EpochOrder(0, False, 0), torch.device("cuda"),
                      False, Augmenter([streams.transform], 0, CPU))
    assert list(feed.epoch(0)) == []
    assert not [e for e in streams.log if e[0] == "transform"]


def test_without_transforms_a_cpu_feed_has_no_prefetcher():
    feed = build_feed(images(), batch_size=8, device=CPU, config=TrainConfig())
    assert feed.prefetch is None and not feed.augment
    x, index = next(feed.epoch(0))  # the labels are the samples' indices
    assert torch.equal(x, images()[0][index])  # untouched


@pytest.mark.parametrize("seed", [0, 7])
def test_inline_and_ahead_give_the_same_values(monkeypatch, seed):
    """The draws depend on (seed, epoch, position) only: the fake side stream sees the same batches."""
    x, y = images()
    inline = list(build_feed((x, y), batch_size=8, device=CPU,
                             config=TrainConfig(transforms=augmentations(), seed=seed)).epoch(1))
    FakeStreams(monkeypatch)
    feed = TensorFeed((x, y), 8, EpochOrder(40, True, seed), torch.device("cuda"), False,
                      Augmenter(augmentations(), seed, CPU))
    feed.prefetch.copy = lambda batch: batch
    ahead = list(feed.epoch(1))
    assert len(ahead) == len(inline) == 5
    for a, b in zip(inline, ahead):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
