"""Debugging values: the graph interpreter, statistics, inspect, comparison, precision, progress
lines, tolerances, kernel checks."""
