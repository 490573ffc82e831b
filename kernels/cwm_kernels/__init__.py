"""Compute kernels (the package ``cwm_kernels`` in kernels/): byte shuffle, block gather/scatter.

Each kernel has a vectorized CPU implementation and, where it pays, a Triton GPU twin; one test
suite checks both (the GPU half runs when a GPU is present).
"""
