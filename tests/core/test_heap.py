"""``frozen_heap``: the collector's full passes kept off start-up's objects while a run lasts.

References: CPython's own ``gc.get_freeze_count`` (objects in the permanent
generation) and ``gc.get_objects`` (what later collections walk).
"""

from __future__ import annotations

import gc
import threading

import pytest

from rlengine.core.heap import frozen_heap
from rlengine.rl.run import train


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts and ends with nothing frozen (a failed test must not leave the process frozen)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_objects_alive_at_entry_are_frozen_until_exit_and_later_ones_are_not():
    before = Node()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        after = Node()
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked  # in the permanent generation: no collection walks it
        assert id(after) in tracked
    assert gc.get_freeze_count() == 0
    assert id(before) in {id(o) for o in gc.get_objects()}


def test_cycles_made_inside_are_collected_and_frozen_ones_after_the_exit():
    import weakref

    old = Node()
    old_ref = weakref.ref(old)
    with frozen_heap():
        new = Node()
        new_ref = weakref.ref(new)
        del new, old
        gc.collect()
        assert new_ref() is None  # made after the freeze: collected as always
        assert old_ref() is not None  # frozen: waits for the unfreeze
    gc.collect()
    assert old_ref() is None


def test_nested_and_overlapping_uses_unfreeze_once_the_last_exits():
    with frozen_heap():
        with frozen_heap():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the outer one still holds it

        entered, leave = threading.Event(), threading.Event()

        def other() -> None:
            with frozen_heap():
                entered.set()
                leave.wait(10)

        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(10)
    assert gc.get_freeze_count() > 0  # the other thread's use outlives this one
    leave.set()
    thread.join(10)
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_heap_itself_keeps_it_frozen():
    gc.freeze()
    mine = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() >= mine > 0


@pytest.mark.model_plane
def test_an_rl_run_trains_with_the_heap_frozen_and_leaves_it_thawed(tmp_path):
    seen: list[int] = []
    outcome = train("copy", {"backend": "torch", "steps": "2", "groups_per_batch": "2", "group_size": "2",
                             "num_substeps": "1", "eval_every": "0", "checkpoint_every": "0",
                             "cache_dir": str(tmp_path / "cache")},
                    run_dir=str(tmp_path / "run"), on_step=lambda record: seen.append(gc.get_freeze_count()))
    assert outcome.error is None, outcome.error
    assert len(seen) == 2 and all(count > 0 for count in seen), seen
    assert gc.get_freeze_count() == 0
