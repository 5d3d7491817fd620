"""What is chosen per host: CPU detection and tuning (``cpu``), importing Paddle (``paddle_setup``),
the numba attention kernels (``attention``), the packed MKL GEMM (``gemm``) and the one way a mode
flag picks a backend or falls back (``choice``). A device backend (GPU) would sit beside these as
its own module behind the same mode choice."""
