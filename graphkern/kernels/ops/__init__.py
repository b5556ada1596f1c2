"""One module per library kernel: its sources, reference, layer function and registry entry."""
