"""What graphkern knows of each model family, one module a family: the forwards it recognises, the
layout of its blocks and the few layers of its own. The machinery (patched layers, segments,
stacks) lives in ``graphkern.models.layers``; ``graphkern.models.patching`` makes rules of this.
"""
