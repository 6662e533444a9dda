import pytest

from pytest_cudagraph.gpu import devices_for_worker


def test_two_workers_get_different_gpus():
    assert devices_for_worker(0, 2, None, 2) == "0"
    assert devices_for_worker(1, 2, None, 2) == "1"


def test_outer_visible_devices_are_indexed_not_replaced():
    assert devices_for_worker(0, 2, "4,6", 8) == "4"
    assert devices_for_worker(1, 2, " 4, 6 ", 8) == "6"


def test_more_workers_than_gpus_share_round_robin():
    assert [devices_for_worker(i, 3, None, 2) for i in range(3)] == ["0", "1", "0"]


def test_no_gpu_or_single_worker_changes_nothing():
    assert devices_for_worker(0, 2, None, 0) is None
    assert devices_for_worker(0, 1, None, 4) is None


def test_a_worker_replacing_a_crashed_one_takes_a_slot_of_the_workers():
    """xdist numbers replacements on (gw2, gw3, ... with -n 2)."""
    assert [devices_for_worker(i, 2, None, 2) for i in (2, 3, 4)] == ["0", "1", "0"]
    assert devices_for_worker(5, 3, "4,6", 8) == "4"  # slot 2 of 3 workers, round-robin over two GPUs


def test_bad_worker_index():
    with pytest.raises(ValueError, match="index >= 0"):
        devices_for_worker(-1, 2, None, 2)
    with pytest.raises(ValueError, match="n_workers >= 1"):
        devices_for_worker(0, 0, None, 2)
