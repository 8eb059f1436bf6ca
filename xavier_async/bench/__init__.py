"""The benchmark harness (``xavier-async bench``): sections, the xoscar anchor, bare channel
copies and the command line. The engine never imports this package."""

from .common import BenchOptions, bench_layout, make_trace, stats, trace_payload
from .suite import run

__all__ = ["BenchOptions", "bench_layout", "make_trace", "run", "stats", "trace_payload"]
