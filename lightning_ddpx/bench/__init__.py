"""Benchmark communication hooks on your own model: ``python -m lightning_ddpx.bench --help``."""

from lightning_ddpx.bench.cli import main

__all__ = ["main"]
