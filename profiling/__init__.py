"""graphrt.profiling: NVTX phase ranges, per-phase kernel-time attribution, Nsight readers."""
