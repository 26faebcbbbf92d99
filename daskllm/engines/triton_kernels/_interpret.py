"""Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors).

The interpreter holds bfloat16 as raw uint16 and computes nothing on it: under it, 16-bit
operands are widened to float32 before any arithmetic (the GPU code is unchanged).
"""

import os

WIDEN = os.environ.get("TRITON_INTERPRET") == "1"
