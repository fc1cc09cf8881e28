"""No lightning_ddpx thread outlives training: a notebook or a test process that trains again must not
accumulate them (Lightning's own test suite fails a test that leaves a thread behind).

The progress writer (:mod:`lightning_ddpx.engine.agreement.progress_board`) and the communication thread
(:mod:`lightning_ddpx.engine.transport.launcher`) end when the module is closed, which the Trainer strategy does at
teardown and the Fabric strategy in ``strategy.teardown()``. The writer also ends with its board (the module
collected), after a while without records, and on ``stop()`` -- how Lightning's test fixtures stop
left-over daemon threads. Oracle: Lightning's ``ddp`` leaves no thread of its own after ``fit``.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist

from lightning_ddpx.engine.agreement import progress_board
from lightning_ddpx.engine.agreement.progress_board import WRITER_THREAD_NAME, ProgressBoard
from tests.dist_utils import one_rank_group, run_distributed
from tests.strategy_helpers import fit, quiet

OURS = "lightning_ddpx"


def our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(OURS) and t.is_alive())


def writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_THREAD_NAME and t.is_alive()]


# ------------------------------------------------------------------------------- the progress writer
def test_close_ends_the_writer_before_returning():
    with one_rank_group():
        board = ProgressBoard(dist.group.WORLD)
        board.record("bucket {}", 0)
        assert len(writers()) == 1  # started by the first record (one is always due then)
        assert board.close() is True
        assert writers() == []


def test_a_collected_board_ends_its_writer():
    with one_rank_group():
        board = ProgressBoard(dist.group.WORLD)
        board.record("bucket {}", 0)
        (writer,) = writers()
        del board
        gc.collect()
        writer.join(5.0)
        assert not writer.is_alive()


def test_stop_ends_the_writer_and_the_next_record_starts_another():
    with one_rank_group():
        board = ProgressBoard(dist.group.WORLD)
        board.record("bucket {}", 0)
        (writer,) = writers()
        assert writer.daemon and callable(writer.stop)  # what Lightning's thread police calls
        writer.stop()
        assert not writer.is_alive()
        board._written_at = float("-inf")  # the next record is due
        board.record("bucket {}", 1)
        (again,) = writers()
        assert again is not writer
        board.close()


def test_an_idle_writer_ends_by_itself(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(progress_board, "_IDLE_EXIT_S", 0.01)
    with one_rank_group():
        board = ProgressBoard(dist.group.WORLD)
        board.record("bucket {}", 0)
        (writer,) = writers()
        writer.join(5.0)
        assert not writer.is_alive() and board._writer is None
        board._written_at = float("-inf")
        board.record("bucket {}", 1)  # a later record is written again, by a new writer
        assert len(writers()) == 1
        board.close()


# --------------------------------------------------------------------------- Trainer and Fabric runs
class ThreadsDuringFit:
    """Callback recording our threads while training runs (so the test sees that there were some)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def as_callback(self):
        from lightning.pytorch import Callback

        seen = self.seen

        class Record(Callback):
            def on_train_batch_end(self, *args, **kwargs) -> None:
                seen.update(our_threads())

        return Record()


def threads_job(rank: int, world_size: int) -> dict:
    quiet()
    from lightning.fabric import Fabric

    from lightning_ddpx import DDPXStrategy
    from lightning_ddpx.lightning.strategies.fabric import DDPXStrategy as FabricDDPXStrategy

    out: dict = {}
    before = set(threading.enumerate())
    for label, strategy in (
        ("ddp", "ddp"),
        ("ddpx", "ddpx"),
        ("ddpx_powersgd", DDPXStrategy(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 2})),
        ("ddpx again", "ddpx"),
    ):
        during = ThreadsDuringFit()
        fit(strategy, max_steps=3, callbacks=[during.as_callback()])
        out[label] = {"during": sorted(during.seen), "after": our_threads()}
        out[label]["new"] = sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())

    # Fabric: the same process, its group already exists (the Trainer created it).
    def run_fabric() -> tuple[Fabric, torch.nn.Module]:
        strategy = FabricDDPXStrategy(comm_hook="powersgd", powersgd={"start_powerSGD_iter": 2})
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
            fabric.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        return fabric, model

    before = set(threading.enumerate())
    fabric, model = run_fabric()
    new = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    out["fabric during"] = sorted(t.name for t in new)
    # Lightning's thread police: a left-over daemon thread must stop when its stop() is called
    out["fabric police"] = {
        t.name: (t.daemon and callable(getattr(t, "stop", None))) for t in new if t.name.startswith(OURS)
    }
    fabric.strategy.teardown()
    out["fabric after teardown"] = our_threads()
    return out


@pytest.mark.slow
@pytest.mark.processes
def test_no_lightning_ddpx_thread_survives_fit_or_a_fabric_teardown():
    results = run_distributed(threads_job, 2, init_process_group=False, timeout=300, pg_timeout=120)
    for out in results:
        assert out["ddp"]["new"] == []  # the oracle: Lightning's ddp leaves no thread behind
        for label in ("ddpx", "ddpx_powersgd", "ddpx again"):
            assert out[label]["after"] == [], label
            assert out[label]["new"] == [], label  # nothing else of ours either, after two fits
        assert WRITER_THREAD_NAME in out["ddpx"]["during"]  # there was a thread to end
        assert "lightning_ddpx-comm" in out["ddpx_powersgd"]["during"]
        assert {WRITER_THREAD_NAME, "lightning_ddpx-comm"} <= set(out["fabric during"])
        assert out["fabric police"][WRITER_THREAD_NAME] is True
        assert out["fabric after teardown"] == []
