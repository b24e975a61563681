"""replayllm.kernels."""
