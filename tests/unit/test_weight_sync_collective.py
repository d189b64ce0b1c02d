"""The weight-sync gloo group runs its broadcasts on ``GLOO_THREADS`` worker threads, not torch's default 2.

An update is a train of asynchronous broadcasts (one per segment) and gloo gives each one worker thread
from start to finish, so the thread count is how many segments can be on the wire at once (measured in
weight_sync/README.md, Bandwidth). Native threads are invisible to ``threading``, so this counts the
process' OS threads (``/proc/self/task``) around building a one-member group.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from weight_sync.collective import GLOO_THREADS, broadcast, build_group, close_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_gloo_group_gets_its_worker_threads_and_still_broadcasts() -> None:
    assert GLOO_THREADS > 2
    store = dist.HashStore()
    before = _os_threads()
    pg = build_group(backend="gloo", store=store, rank=0, world_size=1, epoch=1, timeout_s=10, host="127.0.0.1")
    try:
        assert _os_threads() - before >= GLOO_THREADS
        data = torch.arange(1000, dtype=torch.float32)
        works = [broadcast(pg, chunk) for chunk in data.split(100)]  # many in flight at once, as an update sends
        for work in works:
            work.wait()
        torch.testing.assert_close(data, torch.arange(1000, dtype=torch.float32), rtol=0, atol=0)
    finally:
        close_group(pg)
