"""Llama-layout families: llama, mistral, qwen2 (qkv bias), qwen3 (q/k norm). Data only.

`extra` says what the engine's decoder builds beyond the Llama block: "qkv_bias" (q/k/v carry a bias
whatever the config says), "qk_norm" (an RMSNorm per head on q and k before the rotary embedding)."""

from quantkit.models.registry import ArchSpec, ScaleGroup, register

LLAMA_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)

LLAMA_GROUPS = (
    ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj", needs_equal_shapes=True),
    ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

LLAMA = register(ArchSpec("llama", ("LlamaForCausalLM",), linears=LLAMA_LINEARS, groups=LLAMA_GROUPS))
MISTRAL = register(ArchSpec("mistral", ("MistralForCausalLM",), linears=LLAMA_LINEARS, groups=LLAMA_GROUPS))
QWEN2 = register(
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), linears=LLAMA_LINEARS, groups=LLAMA_GROUPS,
             notes="q/k/v carry a bias; it is kept in fp16 beside the packed weight", qkv_bias=True)
)
QWEN3 = register(
    ArchSpec("qwen3", ("Qwen3ForCausalLM",), linears=LLAMA_LINEARS, groups=LLAMA_GROUPS,
             notes="q_norm/k_norm act per head after the projections and stay unquantized", qk_norm=True)
)
