"""Benchmarks for lightning-ddpx (a package so the scripts can share ``benchmarks.common``)."""
