"""Measuring costs: the profiler, its SQLite store, the analytic accelerator model, allocator
readings."""
