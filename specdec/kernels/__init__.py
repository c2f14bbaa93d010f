"""Attention backends over the paged KV cache: a torch reference (CPU, and the correctness oracle)
and Triton kernels (GPU; also runnable on the CPU under TRITON_INTERPRET=1 for tests)."""
