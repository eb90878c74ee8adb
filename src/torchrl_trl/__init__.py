"""torchrl-trl: mix TorchRL and Hugging Face TRL one piece at a time."""

__version__ = "0.1.0"
