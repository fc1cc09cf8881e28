"""Single-process checks of the package itself and of the engine demo's data helpers (nothing is spawned)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_demo():
    spec = importlib.util.spec_from_file_location("engine_demo", REPO_ROOT / "examples" / "engine_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


def _pyproject_version() -> str:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the version line is simple enough to read directly
        return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)
    return tomllib.loads(text)["project"]["version"]


def test_import_and_version_match_pyproject():
    import lightning_ddpx

    assert lightning_ddpx.__version__ == _pyproject_version()


@pytest.mark.parametrize("num_samples", [1, 10, 1347])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("epoch", [0, 1])
def test_shards_are_disjoint_and_cover_the_data(num_samples, world_size, epoch):
    shards = [demo.shard_indices(num_samples, rank, world_size, epoch) for rank in range(world_size)]
    together = torch.cat(shards)
    assert len(together) == num_samples  # no sample twice ...
    assert torch.equal(together.sort().values, torch.arange(num_samples))  # ... and none left out
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shards_agree_across_calls_and_reshuffle_per_epoch():
    # Ranks compute their shards independently, so the same arguments must give the same shard.
    assert torch.equal(demo.shard_indices(100, 1, 2, epoch=3), demo.shard_indices(100, 1, 2, epoch=3))
    assert not torch.equal(demo.shard_indices(100, 0, 2, epoch=0), demo.shard_indices(100, 0, 2, epoch=1))


def test_shard_rejects_rank_outside_world():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        demo.shard_indices(10, 2, 2)


@pytest.mark.parametrize("num_samples,world_size,batch_size", [(1347, 2, 32), (1347, 3, 50), (7, 2, 2)])
def test_every_rank_takes_the_same_number_of_steps(num_samples, world_size, batch_size):
    steps = demo.steps_per_epoch(num_samples, world_size, batch_size)
    for rank in range(world_size):
        shard = demo.shard_indices(num_samples, rank, world_size)
        batches = demo.split_batches(shard, steps)
        assert len(batches) == steps
        assert all(0 < len(batch) <= batch_size for batch in batches)
        assert torch.equal(torch.cat(batches), shard)


def test_split_batches_says_how_to_fix_too_many_steps():
    with pytest.raises(ValueError, match="larger --batch-size"):
        demo.split_batches(torch.arange(3), 4)


def test_digits_split_is_complete_and_scaled():
    pytest.importorskip("sklearn")
    data = demo.load_digits_split()
    assert len(data.y_train) + len(data.y_test) == 1797
    assert data.x_train.shape[1:] == data.x_test.shape[1:] == (64,)
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0
    assert set(data.y_test.tolist()) == set(range(10))


def test_demo_uses_our_module_unless_told_otherwise():
    assert demo.parse_args([]).reference is False
    assert demo.parse_args(["--reference"]).reference is True


@pytest.mark.processes
def test_importing_the_engine_does_not_load_dynamo():
    """``import lightning_ddpx`` (the engine, what the fault-tolerant launcher and the processes it supervises
    import) leaves ``torch._dynamo`` unloaded: over half a second of start-up on a 2-core CPU (a training
    process pays it later anyway: torch.optim loads dynamo at an optimizer's first parameter group). The
    methods kept out of compiled graphs are disabled for torch.compile once dynamo is loaded
    (tests/engine/test_compile.py)."""
    import subprocess

    probe = "import sys, lightning_ddpx; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.processes
def test_a_destroyed_group_closes_its_connections_when_dynamo_is_imported_after_it():
    """``torch.distributed.nn.functional`` (imported by ``torch._dynamo``, which torch.optim imports lazily)
    takes ``group.WORLD`` as a default argument: first imported while a group exists, it would keep that group
    and its sockets alive after ``destroy_process_group()``, and a fault-tolerant member's peers would wait
    out the collective timeout instead of failing at once. ``import lightning_ddpx`` imports it first. Checked
    on a one-rank gloo group: its sockets are all closed after the destroy. Fails without the import."""
    import subprocess

    probe = """
import gc, os, sys
import torch.distributed as dist
import lightning_ddpx

def sockets():
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count

before = sockets()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
opened = sockets()
import torch._dynamo
dist.destroy_process_group()
gc.collect()
print(before, opened, sockets())
"""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("counts sockets through /proc")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, opened, after = map(int, done.stdout.split())
    assert opened > before, "the group opened no socket: nothing to check"
    assert after == before, f"{opened - after} of the group's {opened - before} sockets closed"
