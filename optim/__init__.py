"""The training engine: DeepSpeed-style config, ZeRO stages 0-3, fp16/bf16, offload, checkpoints.

`from optim import initialize`; `engine, optimizer, loader, scheduler = initialize(model, config=...)`.
"""

from kernels import cpu
from optim.checkpoint import CheckpointError, read_client_state, register_extra_state
from optim.config import ConfigTypeError, EngineConfig, add_config_arguments, parse_config
from optim.engine import Engine, initialize
from optim.monitor import Monitor
from optim.scaler import LossScaler, LossScalerConfig

# the CPU products' measured choices travel with checkpoints: a resumed run multiplies as the straight run did
register_extra_state("gemm", cpu.backend.choices, cpu.backend.adopt)

__all__ = ["CheckpointError", "ConfigTypeError", "Engine", "EngineConfig", "LossScaler", "LossScalerConfig", "Monitor",
           "add_config_arguments", "initialize", "parse_config", "read_client_state"]
