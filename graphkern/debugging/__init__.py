"""Debugging values: the interpreter, comparison, precision, progress lines, tolerances, kernel checks."""
