"""The application's lifespan: start-up objects leave the cyclic collector while serving."""

from __future__ import annotations

import gc


def test_startup_objects_are_frozen_while_serving_and_handed_back_after(gateways):
    running = gateways.start()
    # Frozen, a full collection no longer walks them: no 15-35 ms stall mid-request.
    assert gc.get_freeze_count() > 10_000
    running.server.stop()
    assert gc.get_freeze_count() == 0
