"""DiLoCo and streaming DiLoCo: an inner optimizer steps on local gradients, an outer one on the averaged delta.

DiLoCo (Douillard et al., arXiv 2311.08105) trains each replica alone for ``H`` inner steps with its own
optimizer (AdamW, say) on its own gradients -- nothing is exchanged -- and then takes one *outer* step: the
outer gradient is the replicas' mean parameter change since the last outer step,
``delta = mean_m(anchor - params_m)``, and an outer optimizer (SGD with Nesterov momentum) steps the
*anchor* (the last global parameters) with it; every replica then continues from the new anchor. One
exchange of the parameters every ``H`` steps instead of one of the gradients every step.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) splits the parameters into ``F`` fragments that sync
on a staggered schedule (fragment ``f`` at steps ``o_f, o_f + H, o_f + 2H, ...`` with
``o_f = (f + 1) * H // F``), so each exchange carries ``1/F`` of the model; the exchange runs in the
background while ``tau`` more inner steps are computed (``overlap_steps``), and its result is applied
then: the outer step gives the fragment's new global value ``g``, and the replica's fragment becomes
``alpha * local + (1 - alpha) * g`` (``mixing``; 0 keeps nothing of the ``tau`` local steps). The delta
may be sent in bf16 or fp16, or quantized to 8 or 4 bits (``precision``;
:mod:`~lightning_ddpx.hooks.outer_exchange`), or sparse -- each chunk's top-k in 2 to 8 bits, with the rest
kept per rank as error feedback for the next exchange (``sparse``, SparseLoCo;
:mod:`~lightning_ddpx.hooks.sparse_exchange`). With ``F = 1``, ``tau = 0``, ``alpha = 0`` this is DiLoCo.

During inner steps the module's gradients must not be all-reduced: the registered hook
(:func:`diloco_local_gradients_hook`) hands each bucket back untouched. The outer step runs after every
inner optimizer step through :class:`OuterStep`, the state's
:class:`~lightning_ddpx.engine.optim.parameter_averaging.ParameterAveraging`: registering the hook binds it
to the module's parameters, and ``model.average_parameters_after_step()`` (which the strategies call) runs
it, as it runs post-local SGD's averager. Everything the schedule needs -- the step
counter, the anchors, the outer momentum, any exchange still in flight (waited for, its result kept),
and each rank's error buffers of the sparse exchange -- is in :meth:`DiLoCoState.state_dict`, tensors and
plain values only, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ddpx.engine.buckets.grad_bucket import collectives_issued_on_call
from lightning_ddpx.engine.option_values import check_int, is_finite_number
from lightning_ddpx.engine.transport.backend_support import bf16_reduction_problem
from lightning_ddpx.hooks.default import noop_hook
from lightning_ddpx.hooks.model_averaging import ParamsOrGroups
from lightning_ddpx.hooks.outer_exchange import PRECISIONS, CompletedMean, OuterExchange, start_exchange
from lightning_ddpx.hooks.sparse_exchange import SparseCodec, SparseMean, SparseOptions, error_fed_payload

__all__ = [
    "DiLoCoOptions",
    "DiLoCoState",
    "OuterStep",
    "OuterSync",
    "diloco_local_gradients_hook",
    "fragment_of_parameters",
]

STATE_FORMAT = 1
_KEPT_SYNCS = 1024  # untaken exchange records kept (bytes_sent keeps the total regardless)


def _number(name: str, value: Any, low: float, high: Optional[float] = None) -> float:
    if not is_finite_number(value) or not value >= low:
        raise ValueError(f"diloco option {name} must be a finite number >= {low}, got {value!r}.")
    if high is not None and value > high:
        raise ValueError(f"diloco option {name} must be between {low} and {high}, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class DiLoCoOptions:
    """How often and how the outer step runs. Defaults: the papers' outer optimizer (SGD, lr 0.7, Nesterov
    momentum 0.9), ``H = 100`` (streaming DiLoCo's), one fragment, no overlap, full precision, dense."""

    period: int = 100  # H: inner optimizer steps between two syncs of the same fragment
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1  # F: streaming DiLoCo when > 1
    overlap_steps: int = 0  # tau: inner steps computed while a fragment's exchange is in flight
    mixing: float = 0.0  # alpha: weight of the local fragment when the global one arrives
    # of the outer exchange: "fp32" (the parameters' dtype), "bf16", "fp16", or quantized "int8", "int4"
    precision: str = "fp32"
    # the sparse, error-fed exchange instead (SparseOptions, or a dict of its fields; None: dense)
    sparse: Optional[SparseOptions] = None

    def __post_init__(self) -> None:
        check_int("DiLoCoOptions", "period", self.period, 1)
        period = int(self.period)
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "outer_lr", _number("outer_lr", self.outer_lr, 0.0))
        object.__setattr__(self, "outer_momentum", _number("outer_momentum", self.outer_momentum, 0.0, 1.0))
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"diloco option nesterov must be True or False, got {self.nesterov!r}.")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError(
                "diloco option nesterov=True needs outer_momentum > 0 (Nesterov momentum without momentum is "
                "plain SGD); set outer_momentum (the papers use 0.9) or nesterov=False."
            )
        check_int("DiLoCoOptions", "fragments", self.fragments, 1)
        fragments = int(self.fragments)
        if fragments > period:
            raise ValueError(
                f"diloco option fragments={fragments} exceeds period={period}: each fragment syncs once per "
                "period, at a step of its own. Use at most `period` fragments."
            )
        object.__setattr__(self, "fragments", fragments)
        check_int("DiLoCoOptions", "overlap_steps", self.overlap_steps, 0)
        overlap = int(self.overlap_steps)
        if overlap >= period:
            raise ValueError(
                f"diloco option overlap_steps={overlap} must be less than period={period}: a fragment's exchange "
                "has to be applied before the same fragment is sent again."
            )
        object.__setattr__(self, "overlap_steps", overlap)
        object.__setattr__(self, "mixing", _number("mixing", self.mixing, 0.0, 1.0))
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"diloco option precision must be one of {list(PRECISIONS)}, got {self.precision!r}."
            )
        if self.sparse is not None:
            object.__setattr__(self, "sparse", SparseOptions.from_value(self.sparse))
            if self.precision != "fp32":
                raise ValueError(
                    f"diloco options sparse and precision={self.precision!r} together: the sparse exchange "
                    "sends its values in sparse.bits bits of its own. Leave precision at 'fp32' (the default)."
                )

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> "DiLoCoOptions":
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown diloco option(s) {unknown}; the options are {known}.")
        return cls(**options)

    def offset(self, fragment: int) -> int:
        """The first inner step at which ``fragment`` is sent (then every ``period`` steps)."""
        return (fragment + 1) * self.period // self.fragments


def fragment_of_parameters(numels: list[int], fragments: int) -> list[int]:
    """Fragment index of each parameter: contiguous in ``parameters()`` order, balanced by element count
    (parameter ``i`` goes to ``floor(F * elements_before_i / total)``). Falls back to equal parameter counts
    when that leaves a fragment empty (one parameter larger than the rest together)."""
    if fragments > len(numels):
        raise ValueError(
            f"diloco option fragments={fragments} exceeds the model's {len(numels)} trainable parameters; "
            "each fragment needs at least one. Use fewer fragments."
        )
    total = max(sum(numels), 1)
    assignment, before = [], 0
    for numel in numels:
        assignment.append(min(fragments - 1, before * fragments // total))
        before += numel
    if set(assignment) != set(range(fragments)):
        count = len(numels)
        assignment = [i * fragments // count for i in range(count)]
    return assignment


@collectives_issued_on_call  # none at all: run inline, as noop_hook
def diloco_local_gradients_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DiLoCo's inner steps: each rank keeps its own gradients (no communication, 0 bytes reported)."""
    return noop_hook(state, bucket)


@dataclass(frozen=True)
class OuterSync:
    """One fragment's outer exchange: at which inner step it was sent and how many bytes it carried."""

    step: int
    fragment: int
    bytes_sent: int
    bytes_received: int = 0


@dataclass
class _InFlight:
    apply_at: int  # inner step after which the result is applied
    exchange: OuterExchange  # its result: the mean delta


class DiLoCoState:
    """The hook state of ``comm_hook="diloco"``: options, anchors, outer optimizer, exchanges in flight.

    :meth:`attach` binds it to the module's parameters (every rank must hold the same values then, as after
    the module's initial broadcast; ``model.register_comm_hook`` does it); :attr:`averager`, the
    :meth:`parameter_averaging` it brings, runs the schedule after each inner optimizer step.
    """

    def __init__(
        self, options: Optional[DiLoCoOptions] = None, process_group: Optional[dist.ProcessGroup] = None
    ):
        self.options = options if options is not None else DiLoCoOptions()
        self.process_group = process_group
        self.averager = OuterStep(self)
        self.syncs = 0  # fragment exchanges applied
        self.bytes_sent = 0  # payload bytes of all outer exchanges
        self.bytes_received = 0  # bytes that reached this rank in them
        self._new_syncs: list[OuterSync] = []
        self.params: list[torch.Tensor] = []
        self._watched: list[tuple[str, torch.Tensor, bool]] = []  # (name, parameter, trainable at attach)
        self.anchors: list[torch.Tensor] = []
        self.fragment_of: list[int] = []
        self.errors: list[torch.Tensor] = []  # sparse exchange: this rank's unsent change, per parameter
        self._codecs: dict[int, SparseCodec] = {}  # sparse exchange: each fragment's payload layout
        self.outer_optimizer: Optional[torch.optim.SGD] = None
        self._in_flight: dict[int, _InFlight] = {}
        # the fault tolerance's setting: each exchange completes within the step that sends it (where the
        # members vote on it); its mean is still applied overlap_steps later, mixed as usual
        self.complete_at_send = False

    # --------------------------------------------------------------------------------------- set-up
    @property
    def step(self) -> int:
        """Inner optimizer steps taken."""
        return self.averager.step

    @property
    def replicas_differ(self) -> bool:
        """Whether ranks may hold different weights or inner optimizer state (after the first inner step)."""
        return self.step > 0

    def parameter_averaging(self) -> OuterStep:
        """The outer step, which the module runs at ``model.average_parameters_after_step()``."""
        return self.averager

    def attached_to(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether :meth:`attach` took exactly ``params`` (the same tensors, in the same order)."""
        watched = [p for _, p, _ in self._watched]
        return len(watched) == len(params) and all(a is b for a, b in zip(watched, params))

    def attach(self, params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take ``params`` (the module's parameters, or ``named_parameters()``, in order) as the replica's:
        the trainable ones' values become the anchors. Checks that the backend can reduce the chosen
        precision. The frozen ones are watched: the outer step covers only the parameters trainable now."""
        named = [
            item if isinstance(item, tuple) else (f"parameter {i}", item) for i, item in enumerate(params)
        ]
        self._watched = [(name, p, p.requires_grad) for name, p in named]
        self.params = [p for _, p in named if p.requires_grad]
        if not self.params:
            raise ValueError("comm_hook='diloco': the model has no trainable parameters to synchronise.")
        self.fragment_of = fragment_of_parameters([p.numel() for p in self.params], self.options.fragments)
        with torch.no_grad():
            self.anchors = [p.detach().clone() for p in self.params]
        o = self.options
        self.outer_optimizer = torch.optim.SGD(
            self.anchors, lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.nesterov
        )
        self._in_flight = {}
        if o.sparse is not None:
            self.errors = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
            self._codecs = {
                f: SparseCodec([self.params[i].numel() for i in self.fragment_params(f)], o.sparse)
                for f in range(o.fragments)
            }
        if o.precision == "bf16" and dist.is_initialized():
            problem = bf16_reduction_problem(self.process_group, self.params[0].device)
            if problem is not None:
                raise TypeError(
                    f"comm_hook='diloco' with precision='bf16': {problem}. Use precision='fp16' or 'fp32'."
                )

    def fragment_params(self, fragment: int) -> list[int]:
        return [i for i, f in enumerate(self.fragment_of) if f == fragment]

    # ------------------------------------------------------------------------------------- schedule
    def after_inner_step(self, step: int) -> bool:
        """Run what is due after inner step ``step`` (1-based): send fragments whose turn it is, then apply
        those whose ``overlap_steps`` have passed. Returns whether any fragment was applied."""
        if self.outer_optimizer is None:
            raise RuntimeError(
                "comm_hook='diloco': the state is not attached to a model; model.register_comm_hook(state, "
                "hook) does this (and the strategies, which call it), DiLoCoState.attach(module.parameters()) "
                "for a model used without DistributedDataParallel."
            )
        self._refuse_changed_trainable_set()
        o = self.options
        for fragment in range(o.fragments):
            start = o.offset(fragment)
            if step >= start and (step - start) % o.period == 0:
                self._send(fragment, step)
        for in_flight in self._in_flight.values():
            if in_flight.apply_at - o.overlap_steps + 1 == step:  # sent one step ago: next phase, if any
                in_flight.exchange.advance()
        applied = False
        for fragment in sorted(self._in_flight):
            if self._in_flight[fragment].apply_at == step:
                self._apply(fragment)
                applied = True
        return applied

    def syncs_at(self, step: int) -> bool:
        """Whether inner step ``step`` (1-based) sends or applies a fragment: a collective, or parameters
        changed (what a fault-tolerant run snapshots beforehand)."""
        o = self.options
        sends = any(
            step >= o.offset(fragment) and (step - o.offset(fragment)) % o.period == 0
            for fragment in range(o.fragments)
        )
        return sends or any(in_flight.apply_at == step for in_flight in self._in_flight.values())

    def _refuse_changed_trainable_set(self) -> None:
        """A parameter unfrozen after :meth:`attach` (a fine-tuning schedule) would train on each replica and
        never be synchronised: the replicas would drift apart silently. Refuse it by name (every rank alike,
        as every rank flips the same flags). One frozen later is harmless (its change stays zero)."""
        unfrozen = [name for name, p, was in self._watched if p.requires_grad and not was]
        if unfrozen:
            raise RuntimeError(
                f"comm_hook='diloco': {unfrozen[0]} became trainable after DiLoCo was set up ({len(unfrozen)} "
                "parameter(s) unfrozen). DiLoCo's outer step covers the parameters "
                "trainable when the model was wrapped; one unfrozen later would never be synchronised. Set "
                "requires_grad before wrapping (before fit), or use another comm_hook for fine-tuning schedules "
                "such as BackboneFinetuning."
            )

    def _send(self, fragment: int, step: int) -> None:
        indices = self.fragment_params(fragment)
        overlap = self.options.overlap_steps
        async_op = overlap > 0 and not self.complete_at_send
        what = f"DiLoCo outer delta (fragment {fragment})"
        with torch.no_grad():
            delta = torch.cat([(self.anchors[i] - self.params[i].detach()).reshape(-1) for i in indices])
            if self.options.sparse is not None and delta.numel() > 0:
                exchange = self._start_sparse(fragment, indices, delta, async_op, what)
            else:
                exchange = start_exchange(delta, self.options.precision, self.process_group, async_op, what)
        self.bytes_sent += exchange.bytes_sent
        self.bytes_received += exchange.bytes_received
        self._new_syncs.append(OuterSync(step, fragment, exchange.bytes_sent, exchange.bytes_received))
        del self._new_syncs[:-_KEPT_SYNCS]  # nobody taking them (statistics off): keep the latest only
        if self.complete_at_send:  # the same mean, known now: nothing left in flight across steps
            with torch.no_grad():
                exchange = CompletedMean(exchange.result())
        self._in_flight[fragment] = _InFlight(step + overlap, exchange)

    def _start_sparse(
        self, fragment: int, indices: list[int], delta: torch.Tensor, async_op: bool, what: str
    ) -> OuterExchange:
        """The fragment's change plus this rank's error buffers, sparse; what it does not send (the rounding
        of what it does included) becomes the new error buffers."""
        assert self.options.sparse is not None
        codec = self._codecs[fragment]
        error = torch.cat([self.errors[i].reshape(-1) for i in indices])
        payload, error = error_fed_payload(codec, delta, error, self.options.sparse.error_decay)
        offset = 0
        for i in indices:
            numel = self.errors[i].numel()
            self.errors[i].copy_(error[offset : offset + numel].view_as(self.errors[i]))
            offset += numel
        return SparseMean(payload, codec, self.process_group, async_op, what)

    def _apply(self, fragment: int) -> None:
        in_flight = self._in_flight.pop(fragment)
        indices = self.fragment_params(fragment)
        assert self.outer_optimizer is not None
        alpha = self.options.mixing
        with torch.no_grad():
            mean, offset = in_flight.exchange.result(), 0
            for i in indices:
                anchor = self.anchors[i]
                anchor.grad = mean[offset : offset + anchor.numel()].view_as(anchor).to(anchor.dtype)
                offset += anchor.numel()
            self.outer_optimizer.step()
            for i in indices:
                anchor, param = self.anchors[i], self.params[i].detach()
                anchor.grad = None
                if alpha == 0.0:
                    param.copy_(anchor)
                else:
                    param.copy_(anchor.lerp(param, alpha))
        self.syncs += 1

    @contextlib.contextmanager
    def global_parameters(self) -> Iterator[None]:
        """Inside the block, the replica's trainable parameters hold the global model -- the anchors, the
        outer optimizer's parameters, equal on every rank (what the papers evaluate) -- instead of this
        rank's local values; these are restored on exit. Nothing is communicated. Right after an outer
        step of plain DiLoCo (``overlap_steps=0``, ``mixing=0``) the two are the same."""
        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            for param, anchor in zip(self.params, self.anchors):
                param.detach().copy_(anchor)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(self.params, local):
                    param.detach().copy_(saved)

    def finish(self) -> None:
        """Wait for exchanges still in flight (their results stay pending, as in a checkpoint)."""
        with torch.no_grad():
            for in_flight in self._in_flight.values():
                in_flight.exchange.result()

    def take_syncs(self) -> list[OuterSync]:
        """The exchanges sent since the last call (what the strategies log)."""
        taken, self._new_syncs = self._new_syncs, []
        return taken

    # ---------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"shared": ..., "per_rank": ...}``: the anchors, outer momentum, step and the mean delta of
        exchanges in flight (waited for here) are equal on every rank, stored once; ``per_rank`` holds this
        rank's error buffers of the sparse exchange (``{"errors": [...]}``; ``{}`` for a dense one)."""
        self.finish()
        optimizer = self.outer_optimizer.state_dict() if self.outer_optimizer is not None else None
        shared = {
            "format": STATE_FORMAT,
            "step": self.step,
            "syncs": self.syncs,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "fragment_of": list(self.fragment_of),
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer_optimizer": optimizer,
            "in_flight": {
                f: {"apply_at": x.apply_at, "mean_delta": x.exchange.result().clone()}
                for f, x in self._in_flight.items()
            },
        }
        per_rank = {"errors": [e.clone() for e in self.errors]} if self.options.sparse is not None else {}
        return {"shared": shared, "per_rank": per_rank}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        shared = state_dict["shared"]
        if shared.get("format") != STATE_FORMAT:
            raise ValueError(
                f"DiLoCo state of format {shared.get('format')!r}; this version reads {STATE_FORMAT}."
            )
        anchors = shared["anchors"]
        if [tuple(a.shape) for a in anchors] != [tuple(a.shape) for a in self.anchors]:
            raise ValueError(
                "the checkpoint's DiLoCo anchors do not match this model's trainable parameters (other shapes "
                "or another number of them)."
            )
        if list(shared["fragment_of"]) != self.fragment_of and shared["in_flight"]:
            raise ValueError(
                "the checkpoint was written with another split into fragments while an exchange was in flight; "
                "resume with the same diloco fragments option."
            )
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, anchors):
                anchor.copy_(saved)
        assert self.outer_optimizer is not None
        if shared["outer_optimizer"] is not None:
            self.outer_optimizer.load_state_dict(shared["outer_optimizer"])
            for group in self.outer_optimizer.param_groups:  # this run's options, the saved momentum
                o = self.options
                group.update(lr=o.outer_lr, momentum=o.outer_momentum, nesterov=o.nesterov)
        self.averager.step = int(shared["step"])
        self.syncs = int(shared["syncs"])
        self.bytes_sent = int(shared["bytes_sent"])
        self.bytes_received = int(shared.get("bytes_received", 0))
        self._load_errors((state_dict.get("per_rank") or {}).get("errors"))
        device = self.anchors[0].device
        self._in_flight = {
            int(f): _InFlight(int(x["apply_at"]), CompletedMean(x["mean_delta"].to(device)))
            for f, x in shared["in_flight"].items()
        }
        self._new_syncs = []

    def _load_errors(self, saved: Optional[Sequence[torch.Tensor]]) -> None:
        """This rank's saved error buffers, or zeros (a newcomer, another world size, a dense checkpoint)."""
        if self.options.sparse is None:
            return
        if saved is None:
            for error in self.errors:
                error.zero_()
            return
        if [tuple(e.shape) for e in saved] != [tuple(e.shape) for e in self.errors]:
            raise ValueError(
                "the checkpoint's DiLoCo error buffers (per_rank['errors']) do not match this model's trainable "
                "parameters (other shapes or another number of them)."
            )
        with torch.no_grad():
            for error, value in zip(self.errors, saved):
                error.copy_(value)

    def __repr__(self) -> str:
        return f"DiLoCoState({self.options}, step={self.step}, syncs={self.syncs})"


class OuterStep:
    """DiLoCo's outer schedule as a :class:`~lightning_ddpx.engine.optim.parameter_averaging.ParameterAveraging`:
    counts inner optimizer steps and runs what is due after each (``model.average_parameters_after_step()``
    calls :meth:`after_optimizer_step`). Its state is the :class:`DiLoCoState`'s."""

    name = "DiLoCo's outer step"
    docs = "docs/diloco.md (On the bare module)"

    def __init__(self, state: DiLoCoState) -> None:
        self.state = state
        self.step = 0  # inner optimizer steps taken

    def bind(self, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Attach the state to the module's parameters, unless it holds exactly these already (attached by
        hand, perhaps with a checkpoint loaded since)."""
        if not self.state.attached_to([p for _, p in named_parameters]):
            self.state.attach(named_parameters)

    def after_optimizer_step(self, updated: Optional[Callable[[], Sequence[torch.Tensor]]] = None) -> bool:
        """Count one inner step and run the schedule; returns whether a fragment was applied. ``updated``
        is not asked for: the outer step covers the trainable parameters the state was attached to."""
        self.step += 1
        return self.state.after_inner_step(self.step)

    def due_next(self) -> bool:
        """Whether the next :meth:`after_optimizer_step` exchanges or changes parameters."""
        return self.state.syncs_at(self.step + 1)

    def average_parameters(self, params: ParamsOrGroups = (), *, only_with_grad: bool = True) -> bool:
        """The model averagers' spelling of :meth:`after_optimizer_step`, for loops written for them; the
        outer step's parameters are the attached ones, so ``params`` is not read."""
        return self.after_optimizer_step()

    def global_parameters(self) -> ContextManager[None]:
        return self.state.global_parameters()

    def finish(self) -> None:
        self.state.finish()

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OuterStep({self.state!r})"
