"""Architecture registry and model loading."""

# Importing a family registers it; the registry keeps this order.
from quantkit.models import internlm2, llama_family, llava, qwen, baichuan, chatglm  # noqa: F401,I001
from quantkit.models.registry import (ArchSpec, ScaleGroup, UnsupportedArchitecture, spec_for_architecture,
                                      spec_for_config, supported_architectures)

__all__ = ["ArchSpec", "ScaleGroup", "UnsupportedArchitecture", "spec_for_architecture", "spec_for_config",
           "supported_architectures"]
