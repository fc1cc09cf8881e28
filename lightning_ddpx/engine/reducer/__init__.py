"""The DDP protocol: gradient readiness, in-order bucket launch, unused parameters, finalize.

:class:`~.reducer.Reducer` is the room's front: it owns the iteration's phase (the one place that decides
"between iterations") and the per-iteration state. Around it:

- :mod:`.accumulator_hooks` (when a gradient is final) and :mod:`.backward_start` (the outputs' pre-hooks
  that start a synchronised backward);
- :mod:`.reachability` and :mod:`.used_parameters`: which parameters received a gradient, here and on how
  many ranks (``find_unused_parameters``), and :mod:`.static_graph`'s record of it;
- :mod:`.results_in_order` and :mod:`.bucket_results`: the end of backward, bucket results in launch order;
- :mod:`.late_gradients`: a gradient after the reduction (a backward outside forward), named once;
- :mod:`.messages`: the reducer's errors; :mod:`.comm_stats` and :mod:`.usage_log`: what it reports.
"""
