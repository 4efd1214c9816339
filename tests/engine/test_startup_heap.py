"""`freeze_startup_heap`: the serving process's startup objects leave the collector's scans."""

import gc

from deepinfer.engine.async_llm import freeze_startup_heap


def test_freeze_startup_heap_freezes_every_object_alive():
    kept = [[i] for i in range(1000)]          # tracked containers alive at the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert not any(container is kept for container in gc.get_objects())   # not scanned
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
    assert any(container is kept for container in gc.get_objects())
