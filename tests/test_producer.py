"""The producer thread: items prepared in order in a thread of their own, a bounded number
ahead, errors raised where the item was due, and a stop that ends the thread."""

import threading
import time

import pytest

from gpunb.runtime.feed.producer import Producer


def threads_named(name):
    return [t for t in threading.enumerate() if t.name == name]


def test_items_come_in_order_prepared_in_another_thread_and_at_most_two_ahead():
    prepared, used, threads = [], [], set()

    def prepare(item):
        threads.add(threading.current_thread().name)
        prepared.append(item)
        return item * 2

    producer = Producer(range(20), prepare, ahead=1, name="test-producer")
    for value in producer:
        time.sleep(0.002)  # a consumer slower than the producer: the bound is what holds it back
        used.append(value // 2)
        assert len(prepared) - len(used) <= 2  # one queued, one prepared and waiting for room
    producer.close()
    assert used == list(range(20))
    assert threads == {"test-producer"}
    assert not threads_named("test-producer")


def test_the_context_is_entered_once_in_the_thread_around_the_preparations():
    events = []

    class Within:
        def __enter__(self):
            events.append(("enter", threading.current_thread().name))

        def __exit__(self, *exc):
            events.append(("exit", threading.current_thread().name))

    producer = Producer(range(3), lambda item: events.append(("prepare", item)) or item, within=Within,
                        name="test-within")
    assert list(producer) == [0, 1, 2]
    producer.close()
    assert events == [("enter", "test-within"), ("prepare", 0), ("prepare", 1), ("prepare", 2),
                      ("exit", "test-within")]


@pytest.mark.parametrize("error", [ValueError("bad item 3"), KeyboardInterrupt("bad item 3")])
def test_an_error_is_raised_in_the_consumer_where_the_item_was_due(error):
    def prepare(item):
        if item == 3:
            raise error
        return item

    producer = Producer(range(10), prepare, name="test-error")
    got = []
    with pytest.raises(type(error), match="bad item 3") as raised:
        for item in producer:
            got.append(item)
    producer.close()
    assert raised.value is error and got == [0, 1, 2]
    assert not threads_named("test-error")


def test_close_before_the_end_stops_the_thread_and_prepares_nothing_more():
    prepared = []
    producer = Producer(range(1000), lambda item: prepared.append(item) or item, name="test-close")
    iterator = iter(producer)
    assert [next(iterator), next(iterator)] == [0, 1]
    producer.close()
    count = len(prepared)
    assert count <= 4 and not threads_named("test-close")
    time.sleep(0.1)
    assert len(prepared) == count


def test_an_empty_source_yields_nothing():
    producer = Producer([], lambda item: item, name="test-empty")
    assert list(producer) == []
    producer.close()
    assert not threads_named("test-empty")
