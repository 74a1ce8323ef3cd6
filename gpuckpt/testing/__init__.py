"""Helpers shared by gpuckpt's tests and benchmarks (importable by users' tests too)."""
