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
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from lightning_ddpx._compat.torch import (
    JoinConfig,
    eager_under_compile,
    inputs_to_device,
    params_and_buffers_to_ignore,
    set_params_and_buffers_to_ignore,
)
from lightning_ddpx.engine.agreement.consistency import start_alike, verify_same_settings
from lightning_ddpx.engine.agreement.errors import waiting_for
from lightning_ddpx.engine.agreement.replica_check import ReplicaReport, named_state, verify_replicas
from lightning_ddpx.engine.buckets.plan import (
    BucketInfo,
    is_bucket_cap,
    megabytes_to_bytes,
    resolve_bucket_caps,
)
from lightning_ddpx.engine.buckets.sparse import expects_sparse_gradients
from lightning_ddpx.engine.exit_threads import register_exit_handler
from lightning_ddpx.engine.module import join as joining
from lightning_ddpx.engine.module.pickling import group_for_unpickling, state_to_pickle
from lightning_ddpx.engine.module.placement import DeviceLike, resolve_placement, side_stream_copies
from lightning_ddpx.engine.module.rank_settings import SETTING_OPTIONS, module_settings
from lightning_ddpx.engine.module.synced_buffers import SyncedBuffers
from lightning_ddpx.engine.module.trainable_set import TrainableSet
from lightning_ddpx.engine.module.unsupported_options import (
    UNSUPPORTED_TORCH_ARGUMENTS,
    refuse_unsupported_arguments,
)
from lightning_ddpx.engine.optim.in_backward import refuse_combination, registrations, take_over
from lightning_ddpx.engine.optim.overlap import OptimizerOverlap
from lightning_ddpx.engine.optim.parameter_averaging import (
    BoundAveraging,
    ParameterAveraging,
    parameter_averaging_of,
)
from lightning_ddpx.engine.option_values import check_flags
from lightning_ddpx.engine.reducer import messages as reducer_messages
from lightning_ddpx.engine.reducer.comm_stats import CommStatsSummary, StepCommStats
from lightning_ddpx.engine.reducer.reducer import CommHook, Reducer
from lightning_ddpx.engine.reducer.static_graph import allow_late_static_graph, warn_find_unused_not_needed
from lightning_ddpx.engine.reducer.usage_log import UsageLog, errors_logged, logged_options, logging_data
from lightning_ddpx.engine.transport.backend_support import check_bf16_hook
from lightning_ddpx.engine.transport.hook_signature import check_comm_hook
from lightning_ddpx.engine.transport.shared_memory import local_obstacles
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


class DistributedDataParallel(nn.Module, Joinable):
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
            (:mod:`lightning_ddpx.engine.module.unsupported_options`).

    A wrapped model can be pickled (``torch.save(model)``) and deep-copied, as torch's can, when it averages
    over the default group: the copy leaves the process group and the reducer behind and makes new ones
    (see :meth:`__setstate__`).

    Example::

        >>> import torch.distributed as dist
        >>> from lightning_ddpx import DistributedDataParallel
        >>> dist.init_process_group("gloo")  # doctest: +SKIP
        >>> # device_ids=[local_rank] for a module on that GPU, as with torch's DDP
        >>> model = DistributedDataParallel(net)  # doctest: +SKIP
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # doctest: +SKIP
        >>> loss_fn(model(x), y).backward()  # doctest: +SKIP
        >>> optimizer.step()  # doctest: +SKIP
        >>> with model.no_sync():  # doctest: +SKIP
        ...     loss_fn(model(x), y).backward()  # accumulates; the next synchronised backward averages
    """

    _averaging: BoundAveraging | None = None  # the hook's parameter averaging, once registered
    _failure_report_wait_s = 1.0  # see failure_report_wait_s

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
        self._join_divide_by_initial_world_size = True  # join()'s option; its hook sets it
        self._usage_log = UsageLog()  # torch's usage-logger surface (_get_ddp_logging_data)
        # The driver's options that change collectives (a strategy's uneven_inputs...), compared across ranks
        self.driver_settings: dict[str, str] = {}
        _check_arguments(locals())  # before anything is built
        register_exit_handler()  # gloo may still be releasing the last collective at exit (engine.exit_threads)
        self.module = module
        # torch's ignore list (_set_params_and_buffers_to_ignore_for_model): neither checked, broadcast nor reduced
        self.parameters_to_ignore = params_and_buffers_to_ignore(module)
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
                named,
                self.synced_buffers.tensors() if self._init_sync_buffers else None,
                self.process_group,
                self.device,
                local_obstacles(self.device.type == "cpu"),
            )
            if init_sync
            else None
        )
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

        Collective on two CPU ranks when the model check carried every rank's shared-memory obstacles (it
        maps the shared memory): every rank builds it at once. Without them no collective: the settings
        check chooses the path (:class:`~lightning_ddpx.engine.transport.transports.UndecidedDefault`).
        """
        trainable = self._trainable.trainable()
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
        reducer.before_reduction = weakly(self.verify_settings)  # held weakly: no cycle to collect
        reducer.progress.final_grace_s = self._failure_report_wait_s
        return reducer

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
    @eager_under_compile
    @errors_logged
    def _before_forward(self) -> bool:
        will_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if will_sync and self._averaging is not None:  # before any collective: every rank raises alike
            self._averaging.check_before_sync(self.rank)
        sync_buffers = self.broadcast_buffers and self._sync_buffers_next_forward and self.world_size > 1
        sync_buffers = sync_buffers and self.synced_buffers.exist()  # torch: none to broadcast, no collective
        rebuild_src, buffers_src = 0, self.buffer_source_rank
        if self._join_config.enable:
            rebuild_src, buffers_src = joining.announce_forward(
                self, will_sync, sync_buffers, divide_by_all=self._join_divides_by_all()
            )
        # at any forward, as torch's DDP at its first: a no_sync() backward must not step them either
        self._take_over_optimizers_in_backward()  # before the settings check: it changes the transport
        if will_sync:
            self._follow_trainable_changes()
            self._usage_log.on_sync_forward(self._rebuilt_plan)
        self.reducer.prepare_forward(will_sync, rebuild_src=rebuild_src)
        if sync_buffers:  # this module's first collective may be this one: every rank's settings first
            self.verify_settings()
            self.synced_buffers.broadcast(self.process_group, buffers_src)
        return will_sync

    @eager_under_compile
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
        if self._averaging is not None:
            self._averaging.check_before_sync(self.rank)
        self._follow_trainable_changes()
        self.reducer.prepare_forward(will_sync=True)
        self.reducer.prepare_backward(outputs)

    def _take_over_optimizers_in_backward(self) -> None:
        """torch's ``_apply_optimizer_in_backward`` optimizers step with the average, not the local gradient
        (:mod:`lightning_ddpx.engine.optim.in_backward`); looked for once per forward."""
        seen = registrations()
        if seen != self.reducer.in_backward_seen:
            self.reducer.in_backward_seen = seen
            take_over(self.reducer, self.process_group, self.device, self.comm_hook)

    def verify_settings(self, again: bool = False) -> None:
        """Collective: check that every rank uses the same hook, hook options and reducer options; a
        difference would otherwise surface steps later as a hang or a backend crash.

        Called before the first reduction or buffer broadcast (never at a forward that communicates nothing:
        a rank may run those alone, as with torch's DDP), once per reducer; ``again=True`` compares anew
        (a rank that joined with uneven inputs mirrors the others' check)."""
        reducer = self.reducer
        if (reducer.settings_verified and not again) or self.world_size == 1:
            return
        with waiting_for(
            "every rank to compare its settings (before the first synchronised backward)", self.process_group
        ):
            # each rank's shared-memory obstacles travel with it, for a default path not chosen yet
            obstacles = verify_same_settings(
                self.settings(), self.process_group, self.device, local_obstacles(self.device.type == "cpu")
            )
        reducer.settle_default(obstacles)  # every rank here, in step: no construction is (use_process_group)
        reducer.settings_verified = True

    def _follow_trainable_changes(self) -> None:
        """Before a synchronised backward: if ``requires_grad`` changed on some parameter since the reducer was
        built, agree on the new set across ranks and reduce it from this backward on
        (:mod:`lightning_ddpx.engine.module.trainable_set`). Without a change: one pass over the flags, no collective."""
        if self._trainable.changed() and self.reducer.between_iterations():
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
        among: Sequence[int] | None = None,
    ) -> ReplicaReport:
        """Collective: check that every rank holds bitwise the same parameters (and, if asked, buffers and
        ``optimizer``'s state); raise :class:`~lightning_ddpx.engine.agreement.replica_check.ReplicaMismatchError` on
        every rank, naming the first differing tensor and the ranks, if not.

        Cheap (one pass over the bytes and one ``all_gather`` of a few integers: see
        :mod:`lightning_ddpx.engine.agreement.replica_check`), so it can run every few hundred steps and before each
        checkpoint. Call it on every rank at the same point, between iterations. ``step`` (default: the
        synchronised steps so far) is compared too. Buffers are off by default: with ``broadcast_buffers``
        the ranks' buffers differ between a forward and the next broadcast (e.g. BatchNorm statistics).
        ``among`` (ranks of the module's group): compare only those ranks' replicas with the first's -- a
        replica copied from one peer where the replicas differ by design (DiLoCo between outer steps).
        """
        self.reducer.require_between_iterations(
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
                among=among,
            )

    def settings(self) -> dict[str, str]:
        """What must be equal on every rank, as text: reducer options, the comm hook and its options, the
        transport, and the driver's options (:mod:`lightning_ddpx.engine.module.rank_settings`)."""
        options = {name: getattr(self, name) for name in SETTING_OPTIONS}
        return module_settings(options, self.reducer, self.reducer.hook_registered, self.driver_settings)

    def close(self) -> None:
        """Detach from the wrapped module: remove gradient hooks, stop the communication thread.

        The wrapped module can then be wrapped again (e.g. a second ``Trainer.fit``) without the old
        reducer still reacting to its gradients.
        """
        if self._averaging is not None:
            self._averaging.close()
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
        must finish as it started. A module whose process group was released (a fault-tolerant member's
        failure) reduces nothing until it gets a new one: inside, it accumulates locally all the same.
        """
        released = self.released
        if not released:
            self.reducer.require_between_iterations(
                lambda: reducer_messages.no_sync_while_reducing(self.rank)
            )
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        if not released:
            self.reducer.allow_local_backward()
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ------------------------------------------------------------------------------------- comm hooks
    @errors_logged
    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Use ``hook(state, bucket) -> Future[Tensor]`` to reduce each bucket (torch's signature).

        Call once, before the first backward. See :mod:`lightning_ddpx.engine.buckets.grad_bucket` for how hooks are
        launched and the ordering guarantee. A state that brings parameter averaging (post-local SGD with a
        period, DiLoCo) is bound to this model's parameters here: call :meth:`average_parameters_after_step`
        after every ``optimizer.step()``.
        """
        check_comm_hook(hook)
        if self.reducer.in_backward is not None:
            refuse_combination("this module's parameters have", "register_comm_hook")
        if self.reducer.hook_registered:
            raise RuntimeError(
                f"lightning_ddpx: a communication hook ({self.reducer.transport.name}) is already registered; "
                "register_comm_hook can only be called once. Build a new DistributedDataParallel to change it. "
                "(torch: register_comm_hook or register_builtin_comm_hook can only be called once.)"
            )
        if self.reducer.iterations_synced > 0 or not self.reducer.between_iterations():
            raise RuntimeError(
                "lightning_ddpx: register_comm_hook must be called before the first backward; "
                f"{self.reducer.iterations_synced} synchronised iteration(s) already ran with the default hook."
            )
        # Every rank registers its hook here, so backends of unknown bfloat16 support may be probed.
        check_bf16_hook(hook, self.process_group, self.device, probe=True)
        averaging = parameter_averaging_of(state)  # post-local SGD's averager, DiLoCo's outer step
        if averaging is not None and self.parameter_averaging is not averaging:
            # (the same state again, on a new group's reducer: its averaging stays bound, state and all)
            self.register_parameter_averaging(averaging)
        self.reducer.register_comm_hook(state, hook)

    # ----------------------------------------------------------------------------- parameter averaging
    def register_parameter_averaging(self, averaging: ParameterAveraging) -> None:
        """Run ``averaging`` at each :meth:`average_parameters_after_step`, and refuse a synchronising forward
        after an optimizer step that skipped it (:mod:`lightning_ddpx.engine.optim.parameter_averaging`).

        :meth:`register_comm_hook` calls this for a hook state that brings one (post-local SGD with a
        ``period``, DiLoCo); call it for an algorithm without a hook of its own. Once per module.
        """
        if self._averaging is not None:
            raise RuntimeError(
                f"lightning_ddpx: this model already runs {self._averaging.algorithm.name} after each optimizer "
                f"step; it cannot also run {averaging.name}. Build a new DistributedDataParallel to change it."
            )
        self._averaging = BoundAveraging(averaging, list(self.module.named_parameters()))

    @property
    def parameter_averaging(self) -> ParameterAveraging | None:
        """What :meth:`average_parameters_after_step` runs (post-local SGD's averager, DiLoCo's outer step),
        or ``None``."""
        return self._averaging.algorithm if self._averaging is not None else None

    def average_parameters_after_step(
        self, optimizers: Iterable[torch.optim.Optimizer] | None = None
    ) -> bool:
        """Call after every ``optimizer.step()``: runs the registered hook's parameter averaging -- post-local
        SGD's model average when due, DiLoCo's outer step -- and returns whether it changed the parameters.
        Does nothing (``False``) when the hook has none. A collective when due: call it on every rank.

        Without this call such hooks let each rank train alone, so the next synchronising forward after an
        optimizer step that updated this model raises. ``optimizers``: whose parameters post-local SGD averages
        (each of this model's parameters they hold); ``None``: every parameter with ``requires_grad``.

        Example::

            >>> state, hook = build_comm_hook("diloco", diloco={"period": 50})  # doctest: +SKIP
            >>> model.register_comm_hook(state, hook)
            >>> for x, y in my_batches:
            ...     loss_fn(model(x), y).backward()
            ...     optimizer.step()
            ...     model.average_parameters_after_step()
            ...     optimizer.zero_grad()
        """
        return self._averaging.run(optimizers) if self._averaging is not None else False

    # ------------------------------------------------------------------------------ optimizer overlap
    def overlap_optimizer_with(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Step ``optimizer`` inside each synchronised backward, bucket by bucket, as gradients arrive.

        At the end of backward each bucket's parameters are updated as soon as its averaged gradients are
        written, while later buckets are still communicating; do not call ``optimizer.step()`` after such a
        backward (it raises: the update would apply twice). Backwards inside ``no_sync()`` do not step:
        accumulate, and the synchronised backward steps with the sum. Clip nothing after backward: the
        update already happened. ``None`` switches back to the plain ``optimizer.step()``. See
        :mod:`lightning_ddpx.engine.optim.overlap` for which optimizers qualify and why.
        """
        self.reducer.require_between_iterations(
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

    # --------------------------------------------------------- membership changes (fault tolerance)
    def use_process_group(
        self, process_group: dist.ProcessGroup, comm_hook: tuple[Any, CommHook] | None = None
    ) -> None:
        """Average over ``process_group`` from now on: the membership of a fault-tolerant run changed
        (:mod:`lightning_ddpx.fault`), and every member calls this, between iterations, with the new group.

        The old reducer is closed without waiting for its group, whose peers may be gone, and a new one is
        built with no collective: its default path is chosen with every rank at the first settings check
        (:class:`~lightning_ddpx.engine.transport.transports.UndecidedDefault` says why). The parameters are
        not broadcast: the caller makes the members' replicas equal (a newcomer is healed from a live peer)
        and proves it. ``comm_hook``: the ``(state, hook)`` the new reducer uses; a module with a registered hook needs it
        (only the caller knows whether the hook's state can follow a new group). A parameter averaging it
        brings (DiLoCo's outer step) stays bound as it was: its anchors and counters are kept.
        """
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "lightning_ddpx.DistributedDataParallel.use_process_group: process_group must be a "
                f"torch.distributed.ProcessGroup, got {type(process_group).__name__}."
            )
        reducer = self._reducer
        if reducer is not None:
            reducer.require_between_iterations(
                f"lightning_ddpx (rank {self.rank}): use_process_group was called while this rank's backward "
                "was reducing; call it between iterations."
            )
            if reducer.hook_registered and comm_hook is None:
                raise RuntimeError(
                    f"lightning_ddpx: a communication hook ({reducer.transport.name}) is registered; "
                    "use_process_group needs comm_hook=(state, hook) for the new group."
                )
            reducer.close()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.buffer_source_rank = 0
        self._shared_memory_obstacles = None  # the new group's ranks are asked at its settings check
        self._reducer = self._new_reducer()
        if comm_hook is not None:
            self.register_comm_hook(*comm_hook)

    @property
    def released(self) -> bool:
        """Whether this module let go of its process group (:meth:`release_process_group`, after a
        fault-tolerant member's step failed) and waits for :meth:`use_process_group`: it synchronises
        nothing meanwhile."""
        return self.process_group is None

    def release_process_group(self) -> None:
        """Drop every reference this module holds to its process group (the reducer with it), so that
        destroying the group closes this rank's connections at once: a fault-tolerant member whose step
        failed does this, and a peer still blocked on it in the failed collective fails immediately instead
        of after the group's timeout. Nothing synchronises until :meth:`use_process_group` gives a new group."""
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        self.process_group = None  # type: ignore[assignment]

    @property
    def failure_report_wait_s(self) -> float:
        """How long a rank whose collective failed waits for the other ranks' final progress records before
        raising, so that its error can say what they were doing (1 s). Fault tolerance sets 0: a lost rank
        writes none, and the survivors must go on at once."""
        return self._failure_report_wait_s

    @failure_report_wait_s.setter
    def failure_report_wait_s(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(
                "lightning_ddpx.DistributedDataParallel: failure_report_wait_s must be a number of seconds, got "
                f"{seconds!r} ({type(seconds).__name__})."
            )
        if not seconds >= 0:
            raise ValueError(
                f"lightning_ddpx.DistributedDataParallel: failure_report_wait_s must be seconds >= 0, got {seconds!r}."
            )
        self._failure_report_wait_s = float(seconds)
        if self._reducer is not None:
            self._reducer.progress.final_grace_s = self._failure_report_wait_s

    # ------------------------------------------------------------------ uneven inputs: torch's Joinable
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Train on uneven inputs: ``with model.join(): for batch in my_batches: ...`` (torch's semantics).

        A rank that runs out of batches leaves the loop and, inside the context's exit, shadows the others'
        collectives with zero gradients (through the registered hook, so PowerSGD's collectives match too)
        until every rank has run out; then every rank takes the model of the last rank to finish.
        Gradients are averaged over the initial world size, or, with ``divide_by_initial_world_size=False``,
        over the ranks still training (default hook only: a registered hook divides as it always does,
        as in torch). ``throw_on_early_termination=True`` raises on every rank at the first forward after
        one rank ran out, instead. Equivalent to ``torch.distributed.algorithms.join.Join([model], ...)``;
        collectives outside this module (e.g. SyncBatchNorm, all_gather in the loop) are not shadowed:
        use ``throw_on_early_termination=True`` with those, as torch advises
        (:mod:`lightning_ddpx.engine.module.join`).

        Example::

            >>> with model.join():  # doctest: +SKIP
            ...     for x, y in my_batches:  # each rank may have a different number
            ...         loss_fn(model(x), y).backward()
            ...         optimizer.step()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook torch's ``Join`` runs on a rank that has joined (``divide_by_initial_world_size``)."""
        self._join_divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return joining.DDPXJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    @property
    def inside_join(self) -> bool:
        """Whether a :meth:`join` context is active on this module (its forwards announce themselves)."""
        return bool(self._join_config.enable)

    def end_join(self) -> None:
        """Leave ``join()`` (its hook calls this on every rank): forwards no longer announce themselves and
        the default path averages over the whole group again."""
        self._join_config = JoinConfig.construct_disabled_join_config()
        self.reducer.transport.set_divisor(self.world_size)

    def _join_divides_by_all(self) -> bool:
        """Inside ``join()``: whether the default path keeps dividing by the initial world size."""
        return self._join_divide_by_initial_world_size or self._join_config.throw_on_early_termination

    # ------------------------------------------------------------- settings, the reducer, pickling
    def synced_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters this module synchronises: all but those torch's ignore list names."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Iterable[str]
    ) -> None:
        """torch's way to exclude parameters and buffers (fully qualified names) from data parallelism:
        call it on the module before wrapping; each rank then keeps its own values and gradients of them."""
        set_params_and_buffers_to_ignore(module, params_and_buffers_to_ignore)

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
        if self._reducer is None and self.released:
            raise RuntimeError(
                "lightning_ddpx: this module released its process group (a fault-tolerant member's step "
                "failed); it synchronises again once use_process_group() gives it the new membership's group."
            )
        if self._reducer is None:
            self._reducer = self._new_reducer()
        return self._reducer

    # ------------------------------------------------------------------------------- pickle and copy
    def __getstate__(self) -> dict[str, Any]:
        """What pickling and ``copy.deepcopy`` keep: everything but the process group and the reducer
        (:mod:`lightning_ddpx.engine.module.pickling`; as torch's DDP, only over the default group)."""
        state = state_to_pickle(self.__dict__, self.process_group)
        state["_reducer"] = None  # a new one at first use, with hooks, flags and statistics of its own
        state["_shared_memory_obstacles"] = None  # the process that loads it has its own environment
        state["_usage_log"] = UsageLog()  # as torch's: a new logger
        state.pop("_averaging", None)  # it came with the hook, which the copy registers anew
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
            not self.reducer.synchronising_started(),
            self.find_unused_parameters,
        ):
            self.static_graph = True
            self.reducer.set_static_graph()

    # ------------------------------------------------------------------ what the wrapped model tells
    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch's usage-logger dict, for the keys we fill truthfully (docs/engine.md lists them): the options,
        the parameters and buckets, the sampled iteration and the last error this module raised."""
        params = [p for _, p in self._trainable.trainable()]
        first_plan = self.reducer.plan_history[0][1]
        options = logged_options(self)
        return logging_data(self._usage_log, self.module, params, first_plan, self.process_group, options)

    @errors_logged
    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's check (an integer >= 1); the rate paces ``iteration`` as torch's, no timings are taken."""
        self._usage_log.set_sample_rate(sample_rate)

    def _rebuilt_plan(self) -> list[BucketInfo] | None:
        return self.reducer.bucket_infos() if self.reducer.planner.rebuilt else None

    @property
    def synchronised_steps(self) -> int:
        """How many backward passes have synchronised gradients so far (``no_sync`` ones do not count)."""
        return self.reducer.iterations_synced

    @property
    def comm_hook(self) -> CommHook | None:
        return self.reducer.transport.hook if self.reducer.hook_registered else None

    @property
    def comm_hook_state(self) -> Any:
        return self.reducer.transport.state if self.reducer.hook_registered else None

    @property
    def overlapped_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer given to :meth:`overlap_optimizer_with`, or ``None``."""
        overlap = self.reducer.overlap
        return overlap.optimizer if overlap is not None else None

    @property
    def updates_parameters_in_backward(self) -> bool:
        """Whether backward also steps an optimizer (:meth:`overlap_optimizer_with`, or torch's optimizers in
        backward taken over): the parameters change before the step is over (fault tolerance refuses it)."""
        return self.reducer.overlap is not None or self.reducer.in_backward is not None

    @property
    def optimizer_stepped_in_backward(self) -> bool:
        """Whether the last synchronised backward stepped the overlapped optimizer (until the next forward)."""
        overlap = self.reducer.overlap
        return overlap is not None and overlap.stepped

    def reducer_state_dict(self) -> dict[str, Any]:
        """The bucket layout (parameter names in buffer order), plain values only, for checkpoints.

        Hooks with state (PowerSGD) key their memory by bucket; restoring the layout before the first
        resumed step lets that memory apply exactly, so a resumed run continues bit for bit.
        """
        return self.reducer.order_state()

    def bucket_plan(self) -> list[BucketInfo]:
        """The current buckets in launch order: index, bytes, dtype, device and parameter names."""
        return self.reducer.bucket_infos()

    def bucket_plan_history(self) -> list[tuple[int, list[BucketInfo]]]:
        """Every bucket plan this module used, as ``(synchronised iterations before it, plan)``.

        The first entry is the construction-time plan (torch's: one bucket per dtype unless
        ``find_unused_parameters``); a second one appears when buckets were rebuilt from the observed gradient
        order (after the first iteration; the second with ``static_graph``), or when a checkpoint's layout
        was loaded.
        """
        return list(self.reducer.plan_history)

    def comm_stats(self) -> StepCommStats | None:
        """Communication of the last synchronised step on this rank (``None`` before the first).

        Bytes handed to the hook, bytes its collectives sent (if the hook reports them, as every built-in
        hook does), time inside hook calls and exposed communication; see :mod:`lightning_ddpx.engine.reducer.comm_stats`.
        """
        return self.reducer.stats.last

    def take_comm_stats(self) -> CommStatsSummary | None:
        """Per-step means since the previous call (``None`` if no step synchronised since); starts anew."""
        return self.reducer.stats.window.take()


# torch's True/False arguments and ours; the first two may be None (engine.option_values)
_FLAGS = (
    "broadcast_buffers",
    "forward_sync_buffers",
    "init_sync",
    "check_reduction",
    "find_unused_parameters",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
)


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
