"""A notebook session, as Jupyter or Colab run it, for tests/lightning/test_strategy_names.py: ``python -m
tests.jobs.notebook_job OUT``.

``sys.ps1`` is set before Lightning is imported, which is how Lightning recognises an interactive
environment. The session then trains the same model with Lightning's ``ddp_notebook`` and twice with
``ddpx_notebook`` (2 CPU processes forked from this one; Lightning copies rank 0's weights back here), runs
a Fabric loop with each of ``ddp_notebook`` and ``ddpx_notebook``, tries
``ddpx`` (refused: it would re-run the notebook as a script) and saves what it saw to OUT.
"""

from __future__ import annotations

import sys
import threading
import warnings

sys.ps1 = ">>> "  # before Lightning is imported: what an interactive interpreter has

import torch  # noqa: E402
from lightning.fabric.utilities.imports import _IS_INTERACTIVE  # noqa: E402
from lightning.pytorch import seed_everything  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402

import lightning_ddpx  # noqa: E402, F401 - registers the names, as `import lightning_ddpx` in a cell does
from tests.strategy_helpers import TinyRegressor, make_trainer, parameters_of, quiet  # noqa: E402


def train(strategy: str) -> dict[str, object]:
    seed_everything(0, verbose=False)
    model = TinyRegressor()
    trainer = make_trainer(strategy, max_steps=4)
    trainer.fit(model)
    return {
        "params": parameters_of(model),
        "class": type(trainer.strategy).__name__,
        "start_method": trainer.strategy.launcher._start_method,
    }


def fabric_steps(fabric) -> dict[str, list]:
    """Three steps of a Fabric loop on this rank's own batches; runs in each forked process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * fabric.global_rank + step))
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    fabric.strategy.teardown()
    # plain lists: tensors returned through the launcher's queue are shared by file descriptor, gone with the rank
    return {name: p.detach().tolist() for name, p in model.named_parameters()}


def fabric_train(strategy: str) -> dict[str, object]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    return {"params": fabric.launch(fabric_steps), "class": type(fabric.strategy).__name__}  # rank 0's


def main(out: str) -> None:
    quiet()
    warnings.simplefilter("ignore")
    seed_everything(0, verbose=False)
    result: dict[str, object] = {"interactive": _IS_INTERACTIVE, "initial": parameters_of(TinyRegressor())}
    result["ddp_notebook"] = train("ddp_notebook")
    result["ddpx_notebook"] = train("ddpx_notebook")
    result["ddpx_notebook again"] = train("ddpx_notebook")
    result["fabric ddp_notebook"] = fabric_train("ddp_notebook")
    result["fabric ddpx_notebook"] = fabric_train("ddpx_notebook")
    result["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("lightning_ddpx"))
    try:
        make_trainer("ddpx", max_steps=1)
        result["ddpx"] = "accepted"
    except MisconfigurationException as error:
        result["ddpx"] = str(error)
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1])
