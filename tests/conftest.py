import os

import torch

# Triton reads TRITON_INTERPRET when it is imported: set it before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
