"""quantkit: make large language models small and fast.

    import quantkit
    from quantkit import QuantizeConfig, WeightQuantConfig
    quantkit.quantize("MODEL_DIR", QuantizeConfig(method="rtn"), work_dir="OUT")
    model, tok = quantkit.load("OUT")
    print(quantkit.pipeline("OUT")(["Hi, pls intro yourself"]))
"""

from __future__ import annotations

from typing import Any

from quantkit.config import (
    AWQConfig,
    CalibConfig,
    ConfigError,
    KVQuantConfig,
    QuantizeConfig,
    WeightQuantConfig,
    build_config,
    load_recipe,
)

__version__ = "0.1.0"

# The subpackage quantkit.quantize shares its name with the function below: import it first so
# that the function, defined afterwards, is what `quantkit.quantize` names.
import quantkit.quantize as _quantize_pkg  # noqa: E402,F401

__all__ = [
    "AWQConfig", "CalibConfig", "ConfigError", "KVQuantConfig", "QuantizeConfig", "WeightQuantConfig",
    "build_config", "load_recipe", "load", "pipeline", "quantize", "__version__",
]


def quantize(*args: Any, **kwargs: Any):
    """See `quantkit.quantize.api.quantize`."""
    from quantkit.quantize.api import quantize as _quantize

    return _quantize(*args, **kwargs)


def load(*args: Any, **kwargs: Any):
    """See `quantkit.runtime.loader.load`."""
    from quantkit.runtime.loader import load as _load

    return _load(*args, **kwargs)


def pipeline(*args: Any, **kwargs: Any):
    """See `quantkit.runtime.pipeline.pipeline`."""
    from quantkit.runtime.pipeline import pipeline as _pipeline

    return _pipeline(*args, **kwargs)
