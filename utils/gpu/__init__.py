"""The GPU scripts: the check, the lease calls and their CPU rehearsals, the GPU recipes (docs/gpu.md)."""
