"""The training engine (config, ZeRO stages, loss scaler, checkpoints). Built in a later change."""

__all__: list[str] = []
