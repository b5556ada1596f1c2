"""Tracing and the graph: capture, the Graph and its schema, replay, compiled graphs, state, tensor files."""
