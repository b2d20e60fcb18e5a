"""The inference engine: our decoder over a paged (fp16/int8/int4) KV pool, continuous batching.

    from quantkit.engine import Engine, EngineConfig, SamplingParams
    engine = Engine("MODEL_DIR", EngineConfig(kv_bits=8))
    print(engine.generate(["Hi, pls intro yourself"], SamplingParams(max_tokens=64))[0].text)
"""

from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.llm_engine import Engine, RequestOutput, Usage

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "Usage"]
