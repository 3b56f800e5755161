"""The sections of scripts/gpu_check.py, a module each, and what they share (common)."""
