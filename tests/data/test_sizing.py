"""The read side's sizing rule, for machines CI does not have (it has 2 cores)."""

import pytest

from tfspeed.data import sizing
from tfspeed.data.sizing import AUTOTUNE, input_sizes

JPEG = 31_000  # a 256-512 px photo at q90, as stored
RAW_224 = 224 * 224 * 3  # a photo stored for 224 px


def test_two_cores_keeps_the_measured_sizes():
    # What ran at or above the guide on 2 cores: 16 shards at once, AUTOTUNE threads.
    sizes = input_sizes(cores=2, shards=16, record_bytes=JPEG)
    assert (sizes.cycle_length, sizes.read_threads, sizes.group) == (16, AUTOTUNE, 64)
    assert input_sizes(2, 64, JPEG).cycle_length == 16  # more shards: still 16 open
    assert input_sizes(2, 3, JPEG).cycle_length == 3  # never more than the shards
    assert input_sizes(2, 16, RAW_224).group == 13  # big records: 2 MiB groups


def test_more_cores_keep_the_measured_sizes_until_a_many_core_rule_is_measured():
    for cores in (16, 64):
        assert input_sizes(cores, 128, JPEG) == input_sizes(2, 128, JPEG)
        assert input_sizes(cores, 16, RAW_224).group == 13  # per-core cache: as on 2


def test_the_hypothesis_at_sixteen_cores_caps_the_read_threads():
    sizes = sizing.many_core_hypothesis(cores=16, shards=16, record_bytes=JPEG)
    assert (sizes.cycle_length, sizes.read_threads, sizes.group) == (16, 2, 64)
    assert sizing.many_core_hypothesis(16, 1, JPEG).read_threads == 1  # one shard: one thread
    assert sizing.many_core_hypothesis(16, 16, RAW_224).group == 13


def test_the_hypothesis_at_sixty_four_cores_opens_a_shard_per_core():
    sizes = sizing.many_core_hypothesis(cores=64, shards=128, record_bytes=JPEG)
    assert (sizes.cycle_length, sizes.read_threads, sizes.group) == (64, 8, 64)
    assert sizing.many_core_hypothesis(64, 16, JPEG).cycle_length == 16  # only 16 written
    assert sizing.many_core_hypothesis(64, 16, JPEG).read_threads == 8


@pytest.mark.parametrize("cores", [1, 2, 4, 7])
def test_below_many_cores_everything_is_autotuned(cores):
    assert input_sizes(cores, 16, JPEG).read_threads == AUTOTUNE
    assert sizing.many_core_hypothesis(cores, 16, JPEG) == input_sizes(cores, 16, JPEG)


@pytest.mark.parametrize("cores", [8, 12, 16, 24, 32, 48, 64, 96, 128])
def test_read_threads_feed_the_decode_with_slack(cores):
    # Enough read threads for the decode (one feeds ~25 decoding cores, measured), never
    # more than the open shards, and most of the cores left to the decode.
    threads = sizing.many_core_hypothesis(cores, 1024, JPEG).read_threads
    assert threads >= max(2, cores / 25)
    assert threads <= cores // 4
    assert threads <= sizing.many_core_hypothesis(cores, 1024, JPEG).cycle_length


def test_nonsense_inputs_still_give_usable_sizes():
    sizes = input_sizes(cores=0, shards=0, record_bytes=0)
    assert sizes.cycle_length == 1 and sizes.group == sizing.GROUP


def test_the_hypothesis_is_taken_only_where_a_benchmark_asks_for_it(monkeypatch):
    monkeypatch.setenv(sizing.READ_SIZING_ENV, "many_core")
    assert input_sizes(16, 16, JPEG) == sizing.many_core_hypothesis(16, 16, JPEG)
    assert input_sizes(16, 16, JPEG).read_threads == 2
    monkeypatch.delenv(sizing.READ_SIZING_ENV)
    assert input_sizes(16, 16, JPEG).read_threads == AUTOTUNE

