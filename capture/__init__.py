"""graphrt.capture: per-phase, per-batch-size CUDA graph capture and replay, graph inspection."""
