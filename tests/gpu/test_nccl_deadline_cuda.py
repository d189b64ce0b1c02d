"""NCCL deadlines and CUDA IPC on one GPU: what a single lent GPU can show of the weight path between processes.

* A lone NCCL sender (a world of 2 whose peer never joins) goes through tether's collective stage code
  (``CollectiveSender.begin``): the group's deadline fires and the process lives on. ``ncclCommInitRank``
  blocks its thread until every rank joins, so without the deadline kept on a helper thread it never returns.
* A broadcast stalled on the GPU (a one-rank NCCL group behind ``torch.cuda._sleep``): ``wait_work``'s
  deadline fires on the CPU (NCCL's own ``wait()`` returns at once), and the broadcast then runs past the
  group's own timeout without torch's watchdog tearing the process down (its default async error handling).
* A CUDA IPC probe: a tensor's memory handed to a second process (torch's ``reduce_tensor`` /
  ``rebuild_cuda_tensor``) arrives byte for byte, and the second process' write is seen by the first — the
  only GPU-to-GPU path on one GPU (as verl and SGLang colocate).

Each case runs in a spawned child so that a torn-down process shows as its exit code, not a dead pytest;
a child ends with ``os._exit`` after reporting (a deadline may leave a thread blocked inside NCCL).
Real CUDA only: ``TETHER_GPU_SUITE_ON_CPU`` has no NCCL or IPC to stand in for these.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device (NCCL, CUDA IPC)"),
]

CHILD_LIMIT_S = 60.0
"""A child that has not reported by then is a hang (the deadline under test never fired)."""


def _run_child(target: Any, *args: Any) -> dict:
    """Run ``target(conn, *args)`` in a spawned process; its report, with the exit code added."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(CHILD_LIMIT_S):
            pytest.fail(f"{target.__name__}: no report within {CHILD_LIMIT_S:g}s (exit code {proc.exitcode})")
        report = parent.recv()
    except EOFError:
        proc.join(10)
        pytest.fail(f"{target.__name__}: the process died before reporting (exit code {proc.exitcode})")
    finally:
        proc.join(CHILD_LIMIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    report["exitcode"] = proc.exitcode
    return report


def _alive_on_gpu() -> bool:
    """The CUDA context still works (a torn-down communicator may poison it)."""
    x = torch.ones(1 << 10, device="cuda")
    return bool(x.sum().item() == 1 << 10)


def _lone_sender(conn: Any, timeout_s: float) -> None:
    from tether.config.weight_sync import NcclTransport
    from weight_sync.transport import CollectiveSender

    torch.cuda.set_device(0)
    report: dict = {}
    try:
        sender = CollectiveSender(NcclTransport(master_addr="127.0.0.1", master_port=0), timeout_s=timeout_s)
        sender.sources(["ghost:1"], version=1)  # a world of 2: rank 1 never joins
        start = time.monotonic()
        report["began"] = sender.begin("lone-1", ["ghost:1"])
        report["seconds"] = time.monotonic() - start
        # Past the group's own timeout as well: the watchdog, if armed to, would tear the process down now.
        time.sleep(2 * timeout_s + 2)
        report["alive"] = _alive_on_gpu()
    except BaseException as exc:  # reported, so the test names it
        report["error"] = repr(exc)
    conn.send(report)
    conn.close()
    os._exit(0)


def _cycles_per_second() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per second on this GPU (measured, not assumed)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    torch.cuda._sleep(cycles)  # warm up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1000.0)


def _stalled_broadcast(conn: Any, timeout_s: float, stall_s: float) -> None:
    import torch.distributed as dist

    from weight_sync.collective import StageTimeout, broadcast, build_group, close_group, wait_work

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", 0)
    report: dict = {}
    try:
        pg = build_group(
            backend="nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            epoch=1,
            timeout_s=timeout_s,
            host="127.0.0.1",
            device=gpu,
        )
        data = torch.full((1 << 20,), 7.0, device=gpu)
        torch.cuda._sleep(int(stall_s * _cycles_per_second()))  # NCCL's stream waits for this stream
        work = broadcast(pg, data)
        start = time.monotonic()
        try:
            wait_work(work, timeout_s=timeout_s, what="stalled broadcast")
            report["fired"] = False
        except StageTimeout:
            report["fired"] = True
        report["seconds"] = time.monotonic() - start
        # Not aborted yet: the broadcast outlives the group's own timeout (2x the deadline) while the GPU
        # sleeps on; torch's watchdog sees it time out, which by default takes the whole process down.
        torch.cuda.synchronize()
        time.sleep(2.0)  # the watchdog's polls after the broadcast completed late
        report["data_ok"] = bool((data == 7.0).all().item())
        report["alive"] = _alive_on_gpu()
        close_group(pg)
        report["alive_after_close"] = _alive_on_gpu()
    except BaseException as exc:
        report["error"] = repr(exc)
    conn.send(report)
    conn.close()
    os._exit(0)


def _ipc_reader(conn: Any) -> None:
    report: dict = {}
    try:
        rebuild, args = conn.recv()
        shared = rebuild(*args)  # the first process' memory, mapped here through its CUDA IPC handle
        report["device"] = str(shared.device)
        report["bytes"] = shared.cpu().numpy().tobytes()
        shared.add_(1)  # written here, read there
        torch.cuda.synchronize()
        report["wrote"] = True
        del shared
    except BaseException as exc:
        report["error"] = repr(exc)
    conn.send(report)
    conn.recv()  # the first process has read the write back
    conn.close()


def test_a_lone_nccl_sender_misses_its_deadline_and_lives() -> None:
    timeout_s = 3.0
    report = _run_child(_lone_sender, timeout_s)
    assert "error" not in report, report
    assert report["began"] is False, f"begin() claimed a group with a peer that never joined: {report}"
    assert report["alive"] is True, report
    assert report["exitcode"] == 0, report


def test_a_stalled_nccl_broadcast_misses_its_deadline_and_outlives_the_watchdog() -> None:
    report = _run_child(_stalled_broadcast, 1.0, 6.0)
    assert "error" not in report, report
    assert report["fired"] is True, f"wait_work returned while the broadcast was stalled: {report}"
    assert report["data_ok"] is True, report
    assert report["alive"] is True and report["alive_after_close"] is True, report
    assert report["exitcode"] == 0, f"the process was torn down (exit code {report['exitcode']}): {report}"


def test_cuda_ipc_between_two_processes_on_one_gpu() -> None:
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_reader, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        tensor = torch.arange(1 << 16, dtype=torch.float32, device="cuda").mul_(3)
        expected = tensor.cpu().numpy().tobytes()
        torch.cuda.synchronize()
        parent.send(reduce_tensor(tensor))  # (rebuild_cuda_tensor, its arguments: the IPC handle and layout)
        assert parent.poll(CHILD_LIMIT_S), "the reader did not answer"
        report = parent.recv()
        assert "error" not in report, report
        assert report["device"].startswith("cuda"), report["device"]
        assert report["bytes"] == expected, "the bytes read through the IPC handle differ"
        assert report["wrote"] is True
        torch.cuda.synchronize()
        torch.testing.assert_close(
            tensor.cpu(), torch.arange(1 << 16, dtype=torch.float32).mul_(3).add_(1), rtol=0, atol=0
        )
        parent.send("done")
    finally:
        proc.join(CHILD_LIMIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 0, f"the reader exited with {proc.exitcode}"
