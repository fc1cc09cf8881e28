"""Cross-rank agreement and diagnosis: what every rank must hold alike, and what to say when they do not.

- :mod:`.errors`: a failed or timed-out collective becomes a :class:`~.errors.CommunicationError` naming what
  was waited for, the peer, and the timeout to change;
- :mod:`.progress_board`: what every rank last started, read from the store when a collective fails;
- :mod:`.sequence_check`: ``DDPX_DEBUG=1``'s check that every rank reduces the same bucket now;
- :mod:`.consistency`: the construction-time model check and rank 0's broadcast, the settings comparison;
- :mod:`.replica_check`: ``verify_replicas``, bitwise equality of the replicas.

Depends on nothing of the engine but its leaf modules: every other room may use it.
"""
