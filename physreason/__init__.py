"""physreason: toolkit for physical-AI reasoning vision-language models (Cosmos-Reason1 and Cosmos-Reason2)."""

from physreason.errors import ConfigError, InputError, PhysReasonError

__version__ = "0.1.0"

__all__ = ["ConfigError", "InputError", "PhysReasonError", "__version__"]
