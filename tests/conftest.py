"""Suite-wide settings.

NOTE: Triton kernels run on the CPU through Triton's interpreter, which must be chosen before
anything imports triton (the engine imports it lazily, the kernel tests eagerly); setdefault lets a
GPU machine run the same tests compiled with TRITON_INTERPRET=0.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
