"""Architecture registry and model loading."""

from quantkit.models import internlm2, llama_family  # noqa: F401  (register the families)
from quantkit.models import llava  # noqa: F401
from quantkit.models import qwen  # noqa: F401
from quantkit.models import baichuan  # noqa: F401
from quantkit.models import chatglm  # noqa: F401
from quantkit.models.registry import (
    ArchSpec,
    ScaleGroup,
    UnsupportedArchitecture,
    spec_for_architecture,
    spec_for_config,
    supported_architectures,
)

__all__ = [
    "ArchSpec", "ScaleGroup", "UnsupportedArchitecture",
    "spec_for_architecture", "spec_for_config", "supported_architectures",
]
