"""quantkit: make large language models small and fast.

    import quantkit
    from quantkit import QuantizeConfig, WeightQuantConfig
    quantkit.quantize("MODEL_DIR", QuantizeConfig(method="rtn"), work_dir="OUT")
    model, tok = quantkit.load("OUT")
    pipe = quantkit.pipeline("OUT", quantkit.EngineConfig(kv_bits=8))   # on the inference engine
    print(pipe(["Hi, pls intro yourself", "上海是"]))
"""

from __future__ import annotations

from typing import Any

from quantkit.config import (
    AWQConfig,
    CalibConfig,
    ConfigError,
    QuantizeConfig,
    WeightQuantConfig,
    build_config,
    load_recipe,
)

from quantkit.version import __version__

# The subpackage quantkit.quantize (an empty __init__, nothing imported back) shares its name with the
# function below: loaded first, it is not set on this package again when its modules load later, so
# `quantkit.quantize` stays the function.
import quantkit.quantize as _quantize_pkg  # noqa: E402,F401

__all__ = [
    "AWQConfig", "CalibConfig", "ConfigError", "QuantizeConfig", "WeightQuantConfig",
    "build_config", "load_recipe", "load", "load_image", "pipeline", "quantize", "__version__",
    "Engine", "EngineConfig", "SamplingParams",
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
    """See `quantkit.engine.pipeline.pipeline`: batch generation and streaming on the engine."""
    from quantkit.engine.pipeline import pipeline as _pipeline

    return _pipeline(*args, **kwargs)


def load_image(*args: Any, **kwargs: Any):
    """See `quantkit.engine.images.load_image`: a path, PIL image or data:/http(s) URL → an RGB PIL image."""
    from quantkit.engine.images import load_image as _load_image

    return _load_image(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """The engine's API (`quantkit.Engine`, `EngineConfig`, `SamplingParams`), imported when first used."""
    if name in ("Engine", "EngineConfig", "SamplingParams"):
        import quantkit.engine as _engine

        return getattr(_engine, name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
