"""Measuring costs: the profiler, its SQLite store, the analytic model, allocator readings."""
