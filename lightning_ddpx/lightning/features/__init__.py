"""One module per feature that both strategies, Trainer and Fabric, set up the same way.

- :mod:`.diloco_setup`: DiLoCo's options and its outer syncs' metrics;
- :mod:`.post_local_sgd_setup`: post-local SGD's options, state and averaging after each step;
- :mod:`.optimizer_overlap_setup`: ``overlap_optimizer=True``, the optimizer stepping inside backward;
- :mod:`.compile`: ``torch.compile`` of the training step, split at bucket boundaries;
- :mod:`.uneven`: uneven inputs, every rank's loader in lockstep with the others;
- :mod:`.replica_verification`: the ranks' weights compared every N steps and before each checkpoint.
"""
