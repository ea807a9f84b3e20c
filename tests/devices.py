"""The device kernel tests run on: CUDA when present (Triton compiled), else the CPU (Triton interpreted)."""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
