"""The data-parallel engine: torch and ``torch.distributed`` only, no Lightning, no hook implementations.

Rooms, each importing only the rooms listed before it (``tests/project/test_architecture.py`` keeps this order):

1. leaf modules: :mod:`.option_values`, :mod:`.profiling`, :mod:`.weak_calls`, :mod:`.exit_threads`,
   :mod:`.atomic_file`;
2. :mod:`.agreement`: cross-rank agreement and diagnosis (errors, progress board, model and replica checks);
3. :mod:`.buckets`: bucket planning and storage, the hook's ``GradBucket``;
4. :mod:`.transport`: how a bucket crosses the ranks (hook calls in one global order, streams, shared memory);
5. :mod:`.reducer`: the DDP protocol (readiness, in-order launch, unused parameters, finalize);
6. :mod:`.optim`: optimizer steps overlapped with or inside backward, parameter averaging after them;
7. :mod:`.module`: :class:`~lightning_ddpx.engine.module.data_parallel.DistributedDataParallel`, torch's surface;
8. :mod:`.compile`: torch.compile with graphs split at bucket boundaries.

docs/dev/architecture.md draws the whole picture.
"""
