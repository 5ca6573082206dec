"""graphrt.kernels: Triton kernels and the pure-PyTorch reference of each one.

The public entry points dispatch on the device: Triton on CUDA, the reference elsewhere.
"""

from graphrt.kernels.argmax import argmax
from graphrt.kernels.rejection import RejectionOutput, rejection_sample

__all__ = ["argmax", "rejection_sample", "RejectionOutput"]
