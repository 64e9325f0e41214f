"""attnlab.switch_interval: one short GIL switch interval shared by the background threads, restored after."""

from __future__ import annotations

import sys
import threading

import pytest

from attnlab import switch_interval, warm_start


@pytest.fixture
def default_interval():
    """5 ms, with no other user of the short interval left (the warm start, on a GPU build of torch, is one)."""
    warm_start.wait()
    assert switch_interval._users == 0
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(before)


def test_short_inside_and_restored_after(default_interval):
    with switch_interval.short():
        assert sys.getswitchinterval() == pytest.approx(switch_interval.SHORT_S)
    assert sys.getswitchinterval() == default_interval


def test_overlapping_users_restore_once_the_last_leaves(default_interval):
    """Two threads whose uses overlap: the first to leave keeps it short for the other; the last restores."""
    first_in, first_out, seen = threading.Event(), threading.Event(), {}

    def first():
        with switch_interval.short():
            first_in.set()
            first_out.wait(5)

    t = threading.Thread(target=first)
    t.start()
    first_in.wait(5)
    with switch_interval.short():
        first_out.set()
        t.join(5)
        seen["after the first left"] = sys.getswitchinterval()
    assert seen["after the first left"] == pytest.approx(switch_interval.SHORT_S)
    assert sys.getswitchinterval() == default_interval


def test_a_shorter_setting_of_the_user_is_kept(default_interval):
    sys.setswitchinterval(0.0001)
    kept = sys.getswitchinterval()
    with switch_interval.short():
        assert sys.getswitchinterval() == kept
    assert sys.getswitchinterval() == kept


def test_a_change_made_meanwhile_is_not_undone(default_interval):
    with switch_interval.short():
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_nested_on_one_thread_and_an_error_inside_restore_it(default_interval):
    with pytest.raises(RuntimeError, match="inside"):
        with switch_interval.short():
            with switch_interval.short():
                assert sys.getswitchinterval() == pytest.approx(switch_interval.SHORT_S)
            assert sys.getswitchinterval() == pytest.approx(switch_interval.SHORT_S)
            raise RuntimeError("inside")
    assert sys.getswitchinterval() == default_interval and switch_interval._users == 0
