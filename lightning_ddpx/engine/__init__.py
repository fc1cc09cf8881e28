"""The data-parallel engine: torch and ``torch.distributed`` only, no Lightning, no hook implementations.

:class:`~lightning_ddpx.engine.module.DistributedDataParallel` checks and broadcasts the model, the
:class:`~lightning_ddpx.engine.reducer.Reducer` marks gradients ready, fills buckets planned by
:mod:`~lightning_ddpx.engine.bucketing` and hands each full bucket, in index order, to the communication hook
through a :mod:`~lightning_ddpx.engine.launcher`. docs/dev/architecture.md draws the whole picture.
"""
