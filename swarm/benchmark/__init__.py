"""Every benchmark command (``python -m swarm.benchmark ...``): ratios measured side by side in one run.

``commands`` holds the click group and the latency-hiding and decoding comparisons; ``realscale`` and
``adapter_wire`` measure at LLaDA-8B's widths. Scripts in ``benchmarks/`` that need a lab or hours of training
import from here and from the package, never from the tests.
"""
from swarm.benchmark.commands import main

__all__ = ["main"]
