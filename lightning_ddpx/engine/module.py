"""``lightning_ddpx.DistributedDataParallel``: the ``nn.Module`` users wrap their model in.

It keeps torch's argument names and defaults so switching is a one-line change, and does the
construction-time work (validation, cross-rank model check, broadcast of rank 0's state) before any
training: bad input fails on every rank at once, before work is lost.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from lightning_ddpx._compat.torch import inputs_to_device
from lightning_ddpx.engine import reducer_messages
from lightning_ddpx.engine.backend_support import check_bf16_hook
from lightning_ddpx.engine.bucketing import is_bucket_cap, megabytes_to_bytes, resolve_bucket_caps
from lightning_ddpx.engine.consistency import start_alike, verify_same_settings
from lightning_ddpx.engine.errors import waiting_for
from lightning_ddpx.engine.exit_threads import register_exit_handler
from lightning_ddpx.engine.hook_signature import check_comm_hook
from lightning_ddpx.engine.join import JoinableModule
from lightning_ddpx.engine.module_reports import ModuleReports
from lightning_ddpx.engine.optim_in_backward import refuse_combination, registrations, take_over
from lightning_ddpx.engine.optimizer_overlap import OptimizerOverlap
from lightning_ddpx.engine.option_values import check_flags
from lightning_ddpx.engine.pickling import group_for_unpickling, state_to_pickle
from lightning_ddpx.engine.placement import DeviceLike, resolve_placement, side_stream_copies
from lightning_ddpx.engine.rank_settings import SETTING_OPTIONS, module_settings
from lightning_ddpx.engine.reducer import CommHook, Phase, Reducer
from lightning_ddpx.engine.replica_check import ReplicaReport, named_state, verify_replicas
from lightning_ddpx.engine.shared_memory import local_obstacles
from lightning_ddpx.engine.sparse import expects_sparse_gradients
from lightning_ddpx.engine.static_graph import allow_late_static_graph, warn_find_unused_not_needed
from lightning_ddpx.engine.synced_buffers import SyncedBuffers
from lightning_ddpx.engine.trainable_set import TrainableSet
from lightning_ddpx.engine.unsupported_options import (
    UNSUPPORTED_TORCH_ARGUMENTS,
    refuse_unsupported_arguments,
)
from lightning_ddpx.engine.usage_log import UsageLog, errors_logged
from lightning_ddpx.engine.weak_calls import weakly

__all__ = ["DistributedDataParallel", "NothingToSynchronise"]

# torch's phrase for a module without trainable parameters, kept verbatim in ours (tests written for torch's
# DDP match it).
_TORCH_NO_GRAD_PHRASE = (
    "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a gradient."
)


class NothingToSynchronise(RuntimeError, ValueError):
    """The module has no parameter with ``requires_grad=True``: torch raises RuntimeError, earlier releases of
    lightning_ddpx ValueError; this is both."""


class DistributedDataParallel(nn.Module, JoinableModule, ModuleReports):
    """Data parallelism over ``torch.distributed`` with our own bucketed, hook-driven gradient reducer.

    The arguments are torch's, in torch's order (see docs/engine.md for each one's meaning here).

    Args:
        module: the model; the same architecture must be built on every rank.
        device_ids: torch's meaning: ``None`` for a CPU module; ``[i]`` for a module on GPU ``i``, and forward
            then moves its inputs to that GPU. At most one device; it must be the module's.
        output_device: torch's meaning (defaults to ``device_ids[0]``); outputs stay where the module produced
            them, as in torch's single-device DDP. Must be unset for a CPU module.
        dim: torch's meaning: the dimension torch would split inputs along across the devices of one process,
            which neither torch nor lightning_ddpx does any more; kept as ``self.dim``, unused.
        broadcast_buffers: torch's, deprecated by torch 2.13 (a ``FutureWarning`` when given, as torch's): copy
            rank 0's buffers (e.g. BatchNorm statistics) to all ranks before forward; ``False`` also leaves
            the buffers out of the construction-time broadcast (rank-local buffers keep their values).
            ``None``: ``True``.
        init_sync: check that every rank holds the same parameter shapes and broadcast rank 0's parameters
            and buffers at construction. ``False`` (torch's meaning): skip both; the ranks must already
            hold the same weights.
        process_group: the group to average over (default: the whole world).
        bucket_cap_mb: cap of each gradient bucket in MiB; smaller buckets start communicating earlier,
            larger ones make fewer, more efficient collectives. ``None``: torch's default, 25 MiB after a
            1 MiB first bucket; a number sizes every bucket, the first included (torch's rule).
        find_unused_parameters: walk the autograd graph from forward's outputs each iteration and treat
            parameters it cannot reach as having a zero gradient (needed when forward skips parameters).
        check_reduction: deprecated by torch and ignored (the reduction always completes); ``True`` warns.
        gradient_as_bucket_view: make ``param.grad`` views into the bucket buffers, saving one copy of the
            gradients in memory and a copy per parameter in each step.
        static_graph: torch's meaning: the set of parameters used (and how often each gets a gradient) is the
            same every iteration. The first synchronised iteration records it; later ones mark unused
            parameters without walking the autograd graph, and support activation checkpointing (reentrant
            or not) and parameters whose gradient arrives more than once per backward.
        first_bucket_cap_mb: cap of the first bucket launched (ours). ``None``: torch's rule, 1 MiB when
            ``bucket_cap_mb`` is ``None``, else ``bucket_cap_mb``.
        forward_sync_buffers: torch 2.13's replacement for ``broadcast_buffers``: the same per-forward broadcast,
            but buffers are always broadcast at construction (``None``: take ``broadcast_buffers``); given, it
            wins, as in torch.
        skip_all_reduce_unused_params, batched_grad_copy: torch's optimisations that leave every gradient
            unchanged; accepted and kept as attributes. Our reducer copies each bucket in one batched call
            anyway, and parameters unused on every rank keep their gradient untouched either way.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision, device_mesh,
            bucket_cap_mb_list: torch's, for features not implemented here: accepted at ``None`` (torch's
            default), any other value refused by name with what to use instead
            (:mod:`lightning_ddpx.engine.unsupported_options`).

    A wrapped model can be pickled (``torch.save(model)``) and deep-copied, as torch's can, when it averages
    over the default group: the copy leaves the process group and the reducer behind and makes new ones
    (see :meth:`__setstate__`).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        first_bucket_cap_mb: float | None = None,
        forward_sync_buffers: bool | None = None,
        skip_all_reduce_unused_params: bool = False,
        batched_grad_copy: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        bucket_cap_mb_list: Any = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)  # nn.Module does not chain __init__; the join config starts disabled
        self._join_divide_by_initial_world_size = True
        self._usage_log = UsageLog()  # torch's usage-logger surface (_get_ddp_logging_data)
        # The driver's options that change collectives (a strategy's uneven_inputs...), compared across ranks
        self.driver_settings: dict[str, str] = {}
        _check_arguments(locals())  # before anything is built
        register_exit_handler()  # gloo may still be releasing the last collective at exit (engine.exit_threads)
        self.module = module
        # torch's ignore list (_set_params_and_buffers_to_ignore_for_model): neither checked, broadcast nor reduced
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.synced_buffers = SyncedBuffers(module, self.parameters_to_ignore)
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        every_forward, at_construction = _buffer_rules(broadcast_buffers, forward_sync_buffers)
        self.broadcast_buffers, self._init_sync_buffers = every_forward, at_construction
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        # torch's caps, hence torch's buckets and (past two ranks) torch's sums
        self.first_bucket_cap_mb, self.bucket_cap_mb = resolve_bucket_caps(bucket_cap_mb, first_bucket_cap_mb)
        self.require_backward_grad_sync = True
        self._sync_buffers_next_forward = True  # torch: only after a forward that synchronised
        # whose buffers each forward broadcasts: a strategy's uneven inputs or join() move it off a replaying rank
        self.buffer_source_rank = 0
        self._place_and_sync(device_ids, output_device, dim, init_sync)

    def _place_and_sync(
        self,
        device_ids: Sequence[DeviceLike] | None,
        output_device: DeviceLike | None,
        dim: int,
        init_sync: bool,
    ) -> None:
        """Construction, once the options are set: the device and torch's placement arguments, the model
        check and rank 0's broadcast (``init_sync``), the trainable parameters and the reducer."""
        module = self.module
        if self.static_graph and self.find_unused_parameters:  # as torch's constructor warns
            warn_find_unused_not_needed(stacklevel=4)
        named = self.synced_parameters()
        self.device = _single_device(named)
        placement = resolve_placement(device_ids, output_device, self.device)
        self.device_ids, self.output_device = placement.device_ids, placement.output_device
        self._input_device = placement.input_device
        self.dim = dim
        _check_sync_batchnorm(module, self.device)
        # every rank's shared-memory obstacles, carried by the model check (without it the reducer gathers them)
        self._shared_memory_obstacles = (
            start_alike(
                named, self.synced_buffers.tensors() if self._init_sync_buffers else None, self.process_group,
                self.device, local_obstacles(self.device.type == "cpu"),
            )
            if init_sync
            else None
        )  # fmt: skip
        # requires_grad may change later: followed at each synchronising forward
        self._trainable = TrainableSet(named, unused_allowed=self.find_unused_parameters)
        if not self._trainable.trainable():
            raise NothingToSynchronise(
                "lightning_ddpx.DistributedDataParallel: the module has no parameter with requires_grad=True, "
                "so there is nothing to synchronise. Unfreeze at least one parameter or do not wrap it. "
                f"(torch: {_TORCH_NO_GRAD_PHRASE})"
            )
        self._reducer: Reducer | None = self._new_reducer()

    def _new_reducer(self) -> Reducer:
        """The reducer for the module's trainable parameters, with this module's options.

        Collective on two CPU ranks (it maps the shared-memory slots): every rank builds it at once.
        """
        trainable = self._trainable.trainable()
        self._hook_registered = False
        self._settings_verified = False  # before the first collective, once the hook is registered
        self._in_backward_seen = 0  # _apply_optimizer_in_backward's registrations when last looked at
        reducer = Reducer(
            params=[p for _, p in trainable],
            names=[name for name, _ in trainable],
            process_group=self.process_group,
            first_cap_bytes=megabytes_to_bytes(self.first_bucket_cap_mb),
            cap_bytes=megabytes_to_bytes(self.bucket_cap_mb),
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            sparse_gradients=expects_sparse_gradients(self.module, [p for _, p in trainable]),
            shared_memory_obstacles=self._shared_memory_obstacles,
            usage_log=self._usage_log,
        )
        reducer.before_reduction = weakly(self._verify_settings_once)  # held weakly: no cycle to collect
        return reducer

    def synced_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters this module synchronises: all but those torch's ignore list names."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Iterable[str]
    ) -> None:
        """torch's way to exclude parameters and buffers (fully qualified names) from data parallelism:
        call it on the module before wrapping; each rank then keeps its own values and gradients of them."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]

    @property
    def forward_sync_buffers(self) -> bool:
        """torch 2.13's name for :attr:`broadcast_buffers` (rank 0's buffers before each synchronised forward)."""
        return self.broadcast_buffers

    @forward_sync_buffers.setter
    def forward_sync_buffers(self, value: bool) -> None:
        self.broadcast_buffers = value

    @property
    def reducer(self) -> Reducer:
        """This module's reducer; after unpickling, built at first use (forward, ``no_sync``, a hook...)."""
        if self._reducer is None:
            self._reducer = self._new_reducer()
        return self._reducer

    # ------------------------------------------------------------------------------- pickle and copy
    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` keep: everything but the process group and the reducer
        (:mod:`lightning_ddpx.engine.pickling`; as torch's DDP, only over the default group)."""
        state = state_to_pickle(self.__dict__, self.process_group)
        state["_reducer"] = None  # a new one at first use, with hooks and statistics of its own
        state["_hook_registered"] = state["_settings_verified"] = False
        state["_in_backward_seen"] = 0  # the new reducer takes torch's optimizers in backward over anew
        state["_shared_memory_obstacles"] = None  # the process that loads it has its own environment
        state["_usage_log"] = UsageLog()  # as torch's: a new logger
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild what pickling left behind: the default group now; the reducer at first use, so that
        loading on one rank (e.g. for inference) does not wait for the others."""
        process_group = group_for_unpickling()
        super().__setstate__(state)
        self.process_group = process_group
        register_exit_handler()

    # ---------------------------------------------------------------------------- static graph (torch)
    @errors_logged
    def _set_static_graph(self) -> None:
        """torch's private ``_set_static_graph()``: the same as ``static_graph=True`` at construction.

        Training code calls it after wrapping (e.g. with activation checkpointing); allowed only before the
        first synchronised backward. Called again, it warns and does nothing, as torch's does.
        """
        if allow_late_static_graph(
            self.static_graph,
            self.reducer.iterations_synced,
            self.reducer.phase is Phase.IDLE,
            self.find_unused_parameters,
        ):
            self.static_graph = True
            self.reducer.set_static_graph()

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        will_sync = self._before_forward()
        if self._input_device is not None:  # device_ids, torch's meaning
            args, kwargs = inputs_to_device(args, kwargs, self._input_device, side_stream_copies())
        output = self.module(*args, **kwargs)
        self._after_forward(output, will_sync)
        return output

    # The reducer's bookkeeping is Python state (phases, bucket rebuilds, collectives): under torch.compile it
    # runs eagerly, outside the graph, so the compiled graph holds only the module's computation.
    @torch.compiler.disable
    @errors_logged
    def _before_forward(self) -> bool:
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        sync_buffers = self.broadcast_buffers and self._sync_buffers_next_forward and self.world_size > 1
        sync_buffers = sync_buffers and self.synced_buffers.exist()  # torch: none to broadcast, no collective
        rebuild_src, buffers_src = 0, self.buffer_source_rank
        if self._join_config.enable:
            rebuild_src, buffers_src = self._announce_to_joined_ranks(will_sync, sync_buffers)
        # at any forward, as torch's DDP at its first: a no_sync() backward must not step them either
        self._take_over_optimizers_in_backward()  # before the settings check: it changes the transport
        if will_sync:
            self._follow_trainable_changes()
            self._usage_log.on_sync_forward(self._rebuilt_plan)
        self.reducer.prepare_forward(will_sync, rebuild_src=rebuild_src)
        if sync_buffers:  # this module's first collective may be this one: every rank's settings first
            self._verify_settings_once()
            self.synced_buffers.broadcast(self.process_group, buffers_src)
        return will_sync

    @torch.compiler.disable
    def _after_forward(self, output: Any, will_sync: bool) -> None:
        # A forward that does not synchronise (grad disabled, no_sync) leaves an armed reducer armed, as
        # torch's does: the backward of the synchronising forward before it still averages.
        self._sync_buffers_next_forward = will_sync
        if will_sync:
            self.reducer.prepare_backward(output)

    def prepare_for_backward(self, outputs: Any) -> None:
        """Make the next backward synchronise, for a backward whose forward did not end in :meth:`forward`.

        Lightning's manual optimisation calls ``backward`` inside ``training_step``, i.e. inside this
        wrapper's forward, before forward could arm the reducer; the caller (the strategy) decides when a
        backward should synchronise and calls this with its loss (used to find unused parameters).
        """
        self._follow_trainable_changes()
        self.reducer.prepare_forward(will_sync=True)
        self.reducer.prepare_backward(outputs)

    def _take_over_optimizers_in_backward(self) -> None:
        """torch's ``_apply_optimizer_in_backward`` optimizers step with the average, not the local gradient
        (:mod:`lightning_ddpx.engine.optim_in_backward`); looked for once per forward."""
        seen = registrations()
        if seen != self._in_backward_seen:
            self._in_backward_seen = seen
            take_over(self.reducer, self.process_group, self.device, self.comm_hook)

    def _verify_settings_once(self) -> None:
        """Before the first reduction or buffer broadcast (never at a forward that communicates nothing: a rank
        may run those alone, as with torch's DDP), check that every rank uses the same hook, hook options and
        reducer options; a difference would otherwise surface steps later as a hang or a backend crash."""
        if self._settings_verified or self.world_size == 1:
            return
        with waiting_for(
            "every rank to compare its settings (before the first synchronised backward)", self.process_group
        ):
            verify_same_settings(self.settings(), self.process_group, self.device)
        self._settings_verified = True

    def _follow_trainable_changes(self) -> None:
        """Before a synchronised backward: if ``requires_grad`` changed on some parameter since the reducer was
        built, agree on the new set across ranks and reduce it from this backward on
        (:mod:`lightning_ddpx.engine.trainable_set`). Without a change: one pass over the flags, no collective."""
        if self._trainable.changed() and self.reducer.phase is not Phase.REDUCING:
            self._trainable.adopt_change(
                self.reducer,
                self.module,
                self.process_group,
                self.device,
                inside_join=self._join_config.enable,
            )

    def verify_replicas(
        self,
        *,
        buffers: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        what: str = "",
    ) -> ReplicaReport:
        """Collective: check that every rank holds bitwise the same parameters (and, if asked, buffers and
        ``optimizer``'s state); raise :class:`~lightning_ddpx.engine.replica_check.ReplicaMismatchError` on
        every rank, naming the first differing tensor and the ranks, if not.

        Cheap (one pass over the bytes and one ``all_gather`` of a few integers: see
        :mod:`lightning_ddpx.engine.replica_check`), so it can run every few hundred steps and before each
        checkpoint. Call it on every rank at the same point, between iterations. ``step`` (default: the
        synchronised steps so far) is compared too. Buffers are off by default: with ``broadcast_buffers``
        the ranks' buffers differ between a forward and the next broadcast (e.g. BatchNorm statistics).
        """
        if self.reducer.phase is Phase.REDUCING:
            raise RuntimeError(
                f"lightning_ddpx (rank {self.rank}): verify_replicas was called while this rank's backward is "
                "reducing gradients (from a gradient hook or a backward callback); its collective would interleave "
                "with the buckets'. Call it between iterations, on every rank."
            )
        named = named_state(  # torch's ignore list: those differ across ranks on purpose
            self.synced_parameters(),
            [(n, b) for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]
            if buffers
            else (),
            optimizer,
        )
        with waiting_for("every rank's replica digest (verify_replicas)", self.process_group):
            return verify_replicas(
                named,
                self.process_group,
                self.synchronised_steps if step is None else step,
                device=self.device,
                what=what,
            )

    def settings(self) -> dict[str, str]:
        """What must be equal on every rank, as text: reducer options, the comm hook and its options, the
        transport, and the driver's options (:mod:`lightning_ddpx.engine.rank_settings`)."""
        options = {name: getattr(self, name) for name in SETTING_OPTIONS}
        return module_settings(options, self.reducer, self._hook_registered, self.driver_settings)

    def close(self) -> None:
        """Detach from the wrapped module: remove gradient hooks, stop the communication thread.

        The wrapped module can then be wrapped again (e.g. a second ``Trainer.fit``) without the old
        reducer still reacting to its gradients.
        """
        if self._reducer is None:
            return  # unpickled and never used: nothing attached yet
        if self._reducer.overlap is not None:
            self._reducer.overlap.close()
        self._reducer.close()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip synchronisation for forward+backward passes inside; the next synchronised one averages all.

        Wrap the forward too: whether a backward synchronises is decided when its forward runs. Entering
        it while this rank's backward is already reducing (from a gradient hook or a backward callback) is
        an error: this rank has launched buckets the other ranks are reducing with it, so the iteration
        must finish as it started.
        """
        if self.reducer.phase is Phase.REDUCING:
            raise RuntimeError(reducer_messages.no_sync_while_reducing(self.rank))
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        self.reducer.allow_local_backward()
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ------------------------------------------------------------------------------------- comm hooks
    @errors_logged
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Future[Tensor]`` to reduce each bucket (torch's signature).

        Call once, before the first backward. See :mod:`lightning_ddpx.engine.grad_bucket` for how hooks are
        launched and the ordering guarantee.
        """
        check_comm_hook(hook)
        if self.reducer.in_backward is not None:
            refuse_combination("this module's parameters have", "register_comm_hook")
        if self._hook_registered:
            raise RuntimeError(
                f"lightning_ddpx: a communication hook ({self.reducer.transport.name}) is already registered; "
                "register_comm_hook can only be called once. Build a new DistributedDataParallel to change it. "
                "(torch: register_comm_hook or register_builtin_comm_hook can only be called once.)"
            )
        if self.reducer.iterations_synced > 0 or self.reducer.phase is Phase.REDUCING:
            raise RuntimeError(
                "lightning_ddpx: register_comm_hook must be called before the first backward; "
                f"{self.reducer.iterations_synced} synchronised iteration(s) already ran with the default hook."
            )
        # Every rank registers its hook here, so backends of unknown bfloat16 support may be probed.
        check_bf16_hook(hook, self.process_group, self.device, probe=True)
        self.reducer.register_comm_hook(state, hook)
        self._hook_registered = True

    # ------------------------------------------------------------------------------ optimizer overlap
    def overlap_optimizer_with(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Step ``optimizer`` inside each synchronised backward, bucket by bucket, as gradients arrive.

        At the end of backward each bucket's parameters are updated as soon as its averaged gradients are
        written, while later buckets are still communicating; do not call ``optimizer.step()`` after such a
        backward (it raises: the update would apply twice). Backwards inside ``no_sync()`` do not step:
        accumulate, and the synchronised backward steps with the sum. Clip nothing after backward: the
        update already happened. ``None`` switches back to the plain ``optimizer.step()``. See
        :mod:`lightning_ddpx.engine.optimizer_overlap` for which optimizers qualify and why.
        """
        if self.reducer.phase is Phase.REDUCING:
            raise RuntimeError(
                "lightning_ddpx: overlap_optimizer_with was called while a backward is reducing; call it "
                "between iterations (after optimizer construction, before the next forward)."
            )
        if optimizer is not None and self.reducer.in_backward is not None:
            refuse_combination("this module's parameters have", "overlap_optimizer_with")
        if self.reducer.overlap is not None:
            self.reducer.overlap.close()
        self.reducer.set_overlap(None if optimizer is None else OptimizerOverlap(optimizer, self.reducer))

    def load_reducer_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a layout saved by :meth:`reducer_state_dict` (same parameters; every rank the same state).

        A fine-tuning run saved after unfreezing its backbone is resumed with the backbone frozen again until
        the schedule unfreezes it: ``requires_grad`` changes are followed first, and a layout naming
        parameters that are frozen now is kept and adopted when exactly its parameters are trainable (at the
        forward that notices the change), so the resumed run reduces the saved buckets."""
        self._follow_trainable_changes()
        if not self._trainable.keeps_layout_for_later(state):
            self.reducer.load_order_state(state)


# torch's True/False arguments and ours; the first two may be None (engine.option_values)
_FLAGS = (
    "broadcast_buffers", "forward_sync_buffers", "init_sync", "check_reduction", "find_unused_parameters",
    "gradient_as_bucket_view", "static_graph", "skip_all_reduce_unused_params", "batched_grad_copy",
)  # fmt: skip


def _check_arguments(arguments: dict[str, Any]) -> None:
    """``DistributedDataParallel.__init__``'s arguments (by name): the module, the caps, the group and the
    True/False options are what they must be, torch's arguments this module does not implement ``None``;
    torch's deprecated ``check_reduction`` warns; no default process group is an error."""
    if not isinstance(arguments["module"], nn.Module):
        raise TypeError(
            f"lightning_ddpx.DistributedDataParallel wraps an nn.Module, got {type(arguments['module']).__name__}"
        )
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        if not is_bucket_cap(arguments[name]):
            raise ValueError(
                f"lightning_ddpx.DistributedDataParallel: {name} must be a positive number of MiB (at least one "
                f"byte, finite), got {arguments[name]!r}, or None (torch's default: 25 MiB buckets after a 1 MiB "
                "first one)."
            )
    process_group = arguments["process_group"]
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "lightning_ddpx.DistributedDataParallel: process_group must be a torch.distributed.ProcessGroup "
            f"(e.g. from dist.new_group(...)) or None for the default group, got {type(process_group).__name__}."
        )
    check_flags(
        "lightning_ddpx.DistributedDataParallel", {name: arguments[name] for name in _FLAGS}, _FLAGS[:2]
    )
    refuse_unsupported_arguments(**{name: arguments[name] for name in UNSUPPORTED_TORCH_ARGUMENTS})
    if arguments["check_reduction"]:
        warnings.warn(
            "lightning_ddpx.DistributedDataParallel: check_reduction is ignored (the reduction always "
            "completes); remove it. As torch says: The `check_reduction` argument in "
            "`DistributedDataParallel` module is deprecated. Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "lightning_ddpx.DistributedDataParallel needs an initialised default process group: call "
            "torch.distributed.init_process_group(...) first (Lightning's DDPXStrategy does this for you)."
        )


def _buffer_rules(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """torch 2.13's rule: (broadcast buffers before each synchronised forward, broadcast them at
    construction). ``forward_sync_buffers``, when given, decides the first and buffers are broadcast at
    construction; else ``broadcast_buffers`` (``None``: ``True``) decides both. Passing the deprecated
    ``broadcast_buffers`` warns as torch's does."""
    if broadcast_buffers is not None:
        warnings.warn(
            "lightning_ddpx.DistributedDataParallel: both broadcast_buffers and forward_sync_buffers are given; "
            f"forward_sync_buffers={forward_sync_buffers} decides, as in torch. Pass only forward_sync_buffers. "
            "(torch: Both `broadcast_buffers` and `forward_sync_buffers` were specified.)"
            if forward_sync_buffers is not None
            else "lightning_ddpx.DistributedDataParallel: broadcast_buffers is deprecated by torch; use "
            "forward_sync_buffers, which broadcasts the buffers at construction even when False (keep "
            "broadcast_buffers=False for rank-local buffers). (torch: `broadcast_buffers` is deprecated. Use "
            "`forward_sync_buffers` instead.)",
            FutureWarning,
            stacklevel=3,
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    every_forward = True if broadcast_buffers is None else broadcast_buffers
    return every_forward, every_forward


def _single_device(named: list[tuple[str, nn.Parameter]]) -> torch.device:
    if not named:
        raise NothingToSynchronise(
            "lightning_ddpx.DistributedDataParallel: the module has no parameters to synchronise. "
            f"(torch: {_TORCH_NO_GRAD_PHRASE})"
        )
    first_name, first = named[0]
    for name, param in named:
        if param.device != first.device:
            raise ValueError(
                "lightning_ddpx.DistributedDataParallel needs every parameter on one device, but "
                f"{first_name!r} is on {first.device} and {name!r} is on {param.device}. "
                "Move the whole module with module.to(device) before wrapping it."
            )
    return first.device


def _check_sync_batchnorm(module: nn.Module, device: torch.device) -> None:
    """torch's SyncBatchNorm has GPU kernels only: fail at construction, as torch's DDP does, not in forward."""
    if device.type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, nn.SyncBatchNorm):
            raise ValueError(
                f"lightning_ddpx.DistributedDataParallel: layer {name!r} is a SyncBatchNorm, which torch implements "
                "for GPUs only, but the module is on the CPU (torch's DDP refuses this too). Train on GPUs, or "
                "use plain BatchNorm on the CPU (Trainer(sync_batchnorm=False))."
            )
