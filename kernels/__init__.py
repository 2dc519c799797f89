"""Triton kernels (installed as memtrain.kernels), each beside an eager oracle in reference.py.

Kernels run on CUDA; on the CPU they run under TRITON_INTERPRET=1 (tests use small shapes), and
every caller has a plain-torch fallback for machines without Triton.
"""
