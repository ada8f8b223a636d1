"""Our Triton kernels: smoke tests, launch heuristics, sm_90 code generation."""
