"""No silent desync: every registered hook x every way of training x {uninterrupted, save then resume}.

Each case trains a small MLP on 2 ranks with rank-dependent batches and checks, with
:meth:`~lightning_ddpx.DistributedDataParallel.verify_replicas` (parameters and optimizer state, bitwise),
that the replicas are equal after every step. Every hook here is deterministic, lossy ones (fp16, bf16,
PowerSGD) included, so "bitwise equal" is the bar for all of them; the ``noop`` hook reduces nothing, so for
it the verification must *fail* in every mode (the divergence is loud, not silent). A resumed run must also
end with exactly the uninterrupted run's weights (model, optimizer, hook state and bucket layout restored).

One 2-rank job per hook runs all of its cases (process start-up paid once). Modes:

- ``plain``; ``no_sync`` (two micro-batches, the first inside ``no_sync()``); ``static_graph``;
- ``join``: rank 1 has two batches fewer, inside ``model.join()`` (the verification is a collective the join
  does not shadow, so it runs on the steps both ranks train and after the context, when every rank holds the
  last rank's model);
- ``compile``: ``lightning_ddpx.compile_model`` with the ``aot_eager`` backend (the split at bucket
  boundaries, without the inductor's compile time);
- ``manual``: forward inside ``no_sync()``, then ``prepare_for_backward(loss)`` (what the strategy does for
  Lightning's manual optimisation);
- ``overlap``: ``overlap_optimizer_with``;
- ``unfrozen``: the first layer frozen when wrapped, unfrozen (and added to the optimizer) at step 2.

Not run: ``join`` with ``post_local_sgd`` or ``diloco``: their averagers' collectives are outside the module,
so a rank that joined does not shadow them (as with torch's Join: use ``throw_on_early_termination``).

``diloco`` trains each replica alone between outer synchronisations, on purpose: its replicas are verified
(parameters; the inner optimizers' state stays local by design) right after each outer step, every 2 steps
here, where they must be bitwise equal; a layer unfrozen after wrapping must be refused by name (DiLoCo's
outer step covers the parameters trainable at set-up), never left to drift.
"""

from __future__ import annotations

import io
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ddpx
from lightning_ddpx.engine.agreement.replica_check import ReplicaMismatchError
from lightning_ddpx.hooks import available_hooks, build_comm_hook
from tests.dist_utils import run_distributed
from tests.oracle import rank_batch

pytestmark = pytest.mark.processes

MODES = ("plain", "no_sync", "static_graph", "join", "compile", "manual", "overlap", "unfrozen")
STEPS, SAVE_AT, UNFREEZE_AT = 6, 3, 2
JOIN_SHORTER_BY = 2  # rank 1's batches in the join mode: STEPS - 2
START = 2  # PowerSGD's start_powerSGD_iter, post-local SGD's start_localSGD_iter
HOOK_OPTIONS: dict[str, dict[str, Any]] = {
    "powersgd": {"powersgd": {"start_powerSGD_iter": START, "min_compression_rate": 1.0}},
    "batched_powersgd": {"powersgd": {"start_powerSGD_iter": START, "min_compression_rate": 1.0}},
    "post_local_sgd": {"post_local_sgd": {"start_localSGD_iter": START, "period": 2}},
    "diloco": {"diloco": {"period": 2}},
}
SKIPPED = {
    ("post_local_sgd", "join"): "the model averager's collectives are not shadowed by join",
    ("diloco", "join"): "the outer step's collectives are not shadowed by join",
}
# combinations refused with a named error (the verdict must start with "error" and hold this text)
REFUSED = {("diloco", "unfrozen"): "became trainable after DiLoCo was set up"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


class Run:
    """One case's model, optimizer, hook state and averager, built afresh (or from a checkpoint)."""

    def __init__(self, hook: str, mode: str) -> None:
        self.hook, self.mode = hook, mode
        self.base = mlp()
        if mode == "unfrozen":  # frozen when wrapped
            for p in self.base[0].parameters():
                p.requires_grad_(False)
        self.model = lightning_ddpx.DistributedDataParallel(
            self.base, bucket_cap_mb=0.004, first_bucket_cap_mb=0.001, static_graph=mode == "static_graph"
        )
        self.state, hook_fn = build_comm_hook(hook, **HOOK_OPTIONS.get(hook, {}))
        self.model.register_comm_hook(self.state, hook_fn)
        # post-local SGD's averager, DiLoCo's outer step: bound by the registration, run after every step
        self.averager = self.model.parameter_averaging
        self.synchronised = (
            True  # whether the replicas must agree after this step (DiLoCo: after outer steps)
        )
        trainable = [p for p in self.base.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
        if mode == "overlap":
            self.model.overlap_optimizer_with(self.optimizer)
        if mode == "compile":
            lightning_ddpx.compile_model(self.model, backend="aot_eager")

    def unfreeze(self) -> None:
        """What Lightning's BackboneFinetuning does: unfreeze, and hand the parameters to the optimizer."""
        params = list(self.base[0].parameters())
        for p in params:
            p.requires_grad_(True)
        self.optimizer.add_param_group({"params": params})

    def loss(self, step: int, micro: int = 0) -> torch.Tensor:
        rank = dist.get_rank()
        return self.model(rank_batch(rank, 10 * step + micro, (8, 8))).pow(2).mean() * (rank + 1)

    def step(self, step: int) -> None:
        if self.mode == "unfrozen" and step == UNFREEZE_AT:
            self.unfreeze()
        self.optimizer.zero_grad()
        if self.mode == "no_sync":
            with self.model.no_sync():
                self.loss(step, 1).backward()
            self.loss(step).backward()
        elif self.mode == "manual":
            with self.model.no_sync():
                loss = self.loss(step)
            self.model.prepare_for_backward(loss)
            loss.backward()
        else:
            self.loss(step).backward()
        if not self.model.optimizer_stepped_in_backward:
            self.optimizer.step()
        if self.averager is not None:
            applied = self.model.average_parameters_after_step()
            self.synchronised = self.hook != "diloco" or applied

    def verify_if_synchronised(self, step: int) -> None:
        if self.synchronised:  # DiLoCo: parameters only, the inner optimizers' state is local by design
            self.verify(step, optimizer=self.hook != "diloco")

    def verify(self, step: int, optimizer: bool = True) -> None:
        self.model.verify_replicas(optimizer=self.optimizer if optimizer else None, step=step)

    # ------------------------------------------------------------------------------------- checkpoint
    def save(self) -> bytes:
        state = {
            "model": self.base.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "layout": self.model.reducer_state_dict(),
            "hook": self.state.state_dict() if hasattr(self.state, "state_dict") else None,
            "averager": self.averager.state_dict() if self.averager is not None else None,
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    @classmethod
    def resumed(cls, hook: str, mode: str, saved: bytes, step: int) -> Run:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        run = cls(hook, mode)
        run.base.load_state_dict(state["model"])
        # Lightning's order: the layout is restored right after wrapping, with the backbone frozen again;
        # the schedule unfreezes it afterwards (BackboneFinetuning re-adds its parameter group)
        run.model.load_reducer_state_dict(state["layout"])
        if mode == "unfrozen" and step >= UNFREEZE_AT:
            run.unfreeze()
        run.optimizer.load_state_dict(state["optimizer"])
        if state["hook"] is not None:
            run.state.load_state_dict(state["hook"])
        if run.averager is not None:
            run.averager.load_state_dict(state["averager"])
        return run


def train(hook: str, mode: str, resume: bool) -> dict[str, torch.Tensor]:
    """Train STEPS steps (saving and resuming in a fresh Run at SAVE_AT if ``resume``), verifying each step."""
    last = STEPS - (JOIN_SHORTER_BY if mode == "join" and dist.get_rank() == 1 else 0)
    run = Run(hook, mode)
    segments = [(0, SAVE_AT), (SAVE_AT, STEPS)] if resume else [(0, STEPS)]
    for start, end in segments:
        if start:
            run = Run.resumed(hook, mode, run.save(), start)
        if mode == "join":
            digests = []
            with run.model.join():
                for step in range(start, min(end, last)):
                    run.step(step)
                    digests.append(_local_digest(run))
            _compare_digests(digests, start)
            # after the join every rank holds the last rank's parameters (torch's semantics: a rank that ran out
            # stepped its optimizer less, so its momentum differs)
            run.verify(step=-1, optimizer=False)
        else:
            for step in range(start, end):
                run.step(step)
                run.verify_if_synchronised(step)
    final = {name: p.detach().clone() for name, p in run.base.named_parameters()}
    final["bucket plan"] = torch.tensor(  # the resumed run must reduce the saved run's buckets
        [zlib.crc32(",".join(info.parameter_names).encode()) for info in run.model.bucket_plan()]
    )
    return final


def _local_digest(run: Run) -> torch.Tensor:
    from lightning_ddpx.engine.agreement.replica_check import _fold, tensor_digest

    return _fold(torch.stack([tensor_digest(p) for p in run.base.parameters()]))


def _compare_digests(digests: list[torch.Tensor], start: int) -> None:
    """Inside join(): compare the steps every rank trained, after the context (one all_gather)."""
    count = torch.tensor([len(digests)])
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, count)
    common = int(min(c.item() for c in counts))
    mine = torch.stack(digests[:common]) if common else torch.zeros(0, 2, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in counts]
    dist.all_gather(parts, mine)
    for offset in range(common):
        if not all(torch.equal(part[offset], parts[0][offset]) for part in parts):
            raise ReplicaMismatchError(f"replicas differ after step {start + offset} inside join()")


def run_hook(rank: int, world_size: int, hook: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    outcomes: dict[str, Any] = {}
    for mode in MODES:
        if (hook, mode) in SKIPPED:
            continue
        finals = {}
        for resume in (False, True):
            key = f"{mode}/{'resume' if resume else 'uninterrupted'}"
            try:
                finals[resume] = train(hook, mode, resume)
                outcomes[key] = "equal"
            except ReplicaMismatchError as error:
                outcomes[key] = f"mismatch: {error}"
            except Exception as error:  # noqa: BLE001 - reported per case by the test
                outcomes[key] = f"error: {type(error).__name__}: {error}"
                dist.barrier()  # the same cases failed on every rank (all raise alike), keep in step
        if len(finals) == 2:
            differs = [n for n in finals[False] if not torch.equal(finals[False][n], finals[True][n])]
            outcomes[f"{mode}/resume_matches"] = differs or "same"
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("hook", available_hooks())
def test_replicas_stay_bitwise_equal(hook: str) -> None:
    outcomes = run_distributed(run_hook, 2, hook, timeout=300)
    assert outcomes[0] == outcomes[1]  # every rank reached the same verdicts
    expected_cases = [m for m in MODES if (hook, m) not in SKIPPED]
    problems = []
    for mode in expected_cases:
        for kind in ("uninterrupted", "resume"):
            verdict = outcomes[0][f"{mode}/{kind}"]
            if hook == "noop":  # reduces nothing: the verification must catch it, in every mode
                if not verdict.startswith("mismatch"):
                    problems.append(f"{mode}/{kind}: divergence went unnoticed: {verdict}")
            elif (hook, mode) in REFUSED:
                if not (verdict.startswith("error") and REFUSED[hook, mode] in verdict):
                    problems.append(f"{mode}/{kind}: expected the named refusal, got: {verdict}")
            elif verdict != "equal":
                problems.append(f"{mode}/{kind}: {verdict}")
        if (
            hook != "noop"
            and (hook, mode) not in REFUSED
            and outcomes[0].get(f"{mode}/resume_matches") != "same"
        ):
            problems.append(
                f"{mode}: resumed run differs from the uninterrupted one in {outcomes[0].get(f'{mode}/resume_matches')}"
            )
    assert not problems, "\n".join(problems)
