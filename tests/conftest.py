import os

import torch

# The CPU tests run the Triton kernels through Triton's interpreter, which must be switched on
# before the kernels are defined (when cuflash.kernels is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
