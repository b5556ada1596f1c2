"""Tracing and the graph: ``gk.trace`` (traceable: the recorder, module hooks, the deep stack it runs
on), capture, the Graph and its schema, replay, state, guards, tensor files, and the slots the
layers above fill (extensions)."""
