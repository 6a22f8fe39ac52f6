"""Compute kernels: compact-weight linear layers (int8, MXFP4) and their Triton GEMVs, the fused
RMSNorm, and paged decode attention."""
