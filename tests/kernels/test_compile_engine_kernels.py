"""The engine's Triton kernels (kernels/triton_paged.py, triton_prefill.py, triton_fused.py, triton_fp8.py) compile for Hopper
(sm_90) without a GPU, in the configurations their launchers use at Llama shapes (head_dim 128, GQA
4:1, blocks of 16 tokens). The CPU interpreter runs their Python but not Triton's compiler, which
rejects some programs the interpreter accepts; the compile runs in a subprocess because this folder's
conftest turns the interpreter on for the whole test process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton.language as tl

    from quantkit.kernels import triton_fp8 as t8, triton_fused as tf, triton_paged as tp, triton_prefill as tpf
    from quantkit.kernels.dispatch_table import TABLE
    from quantkit.packing import E4M3_MAX, FP8_MIN_SCALE

    def build(fn, signature, constexprs, **options):
        sig = {**signature, **{k: "constexpr" for k in constexprs}}
        # pointers 16-byte aligned, as the launcher's tensors are (Triton specializes on it: vector loads)
        names = list(fn.arg_names)
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                             target=GPUTarget("cuda", 90, 32), options=options)
        assert out.asm.get("cubin"), (fn.__name__, constexprs)

    count = 0
    for bits in (16, 8, 4):
        codes, zero = ("*fp16", "*fp16") if bits == 16 else ("*u8", "*u8")
        cache = {"kc_ptr": codes, "vc_ptr": codes, "ks_ptr": "*fp16", "kz_ptr": zero, "vs_ptr": "*fp16", "vz_ptr": zero}
        static = {"fks_ptr": "*fp16", "fkz_ptr": zero, "fvs_ptr": "*fp16", "fvz_ptr": zero}
        write = {"k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", **cache, **static, "kv_heads": "i32", "block_size": "i32",
                 "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"}
        for fixed in ((False, True) if bits != 16 else (False,)):  # STATIC: the checkpoint's per-head scales
            build(tp.write_kv_kernel, write, dict(HALF=64, BLOCK_H=8, BLOCK_HALF=64, BITS=bits, STATIC=fixed),
                  num_warps=4)
            count += 1
        decode = {"q_ptr": "*fp16", **cache, "bt_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*fp16",
                  "part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "qk_scale": "fp32",
                  "kv_heads": "i32", "heads": "i32", "partitions": "i32", "stride_qb": "i32", "stride_qh": "i32",
                  "stride_bt": "i32"}
        for split in (False, True):
            build(tp.decode_kernel, decode, dict(GROUP=4, BLOCK_G=16, HALF=64, BLOCK_HALF=64, BLOCK_SIZE=16,
                                                 BLOCK_N=64, BITS=bits, SPLIT=split), num_warps=4)
        count += 2
        prefill = {"q_ptr": "*bf16", **cache, "bt_ptr": "*i32", "ctx_ptr": "*i32", "qstart_ptr": "*i32",
                   "out_ptr": "*bf16", "qk_scale": "fp32", "kv_heads": "i32", "stride_qt": "i32", "stride_qh": "i32",
                   "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32"}
        if bits == 16:
            prefill.update({k: "*bf16" for k in cache})  # K/V in the model's dtype; no scales or zeros
        build(tpf.prefill_kernel, prefill, dict(GROUP=4, ROWS=16, BLOCK_M=64, HALF=64, BLOCK_HALF=64, BLOCK_SIZE=16,
                                                BLOCK_N=64, BITS=bits), num_warps=4 if bits == 16 else 8, num_stages=2)
        count += 1
    build(tp.merge_kernel, {"part_out_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                            "out_ptr": "*fp16", "partitions": "i32"}, dict(D=128, BLOCK_P=tp.MAX_PARTITIONS, BLOCK_D=128), num_warps=4)
    fp8 = dict(MIN_SCALE=FP8_MIN_SCALE, FP8_MAX=E4M3_MAX)
    for residual in (False, True):
        for quant, static in ((False, False), (True, False), (True, True)):  # plain; e4m3 per token; static scale
            build(tf.rms_norm_kernel, {"x_ptr": "*fp16", "res_ptr": "*fp16", "w_ptr": "*fp16",
                                       "out_ptr": "*fp8e4nv" if quant else "*fp16", "h_ptr": "*fp16", "s_ptr": "*fp32",
                                       "static_ptr": "*fp32", "n": "i32", "stride_x": "i32", "stride_r": "i32",
                                       "eps": "fp32"},
                  dict(HAS_RESIDUAL=residual, BLOCK=4096, OUT_DTYPE=tl.float16, QUANT=quant, STATIC=static, **fp8),
                  num_warps=4)
            count += 1
    for static in (False, True):
        build(t8.quantize_kernel, {"x_ptr": "*fp16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32",
                                   "n": "i32", "stride_x": "i32"}, dict(STATIC=static, BLOCK=4096, **fp8), num_warps=4)
        build(t8.silu_mul_quantize_kernel, {"x_ptr": "*fp16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                            "static_ptr": "*fp32", "inter": "i32", "stride_x": "i32"},
              dict(OUT_DTYPE=tl.float16, STATIC=static, BLOCK=2048, **fp8), num_warps=8)
        count += 2
    dot = {"x_ptr": "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*fp32", "bias_ptr": "*fp16",
           "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_om": "i32", "SPLIT_K": "i32"}
    rows = {tuple(sorted(c.params.items())) for key, rows in TABLE.items() if key.startswith("fp8 ")
            for _, c in rows if c.method == "fp8-dot"}
    for params in sorted(rows):
        p = dict(params)
        build(t8.dot_kernel, dot, dict(X_PER_TOKEN=True, W_PER_CHANNEL=True, BLOCK_N=p["block_n"], BLOCK_M=p["block_m"],
                                       BLOCK_K=p["block_k"], SPLIT=p["split_k"] > 1, HAS_BIAS=False,
                                       NUM_STAGES=p["num_stages"]), num_warps=p["num_warps"], num_stages=p["num_stages"])
        count += 1
    for interleaved in (False, True):
        build(tf.rope_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32",
                               "q_heads": "i32", "k_heads": "i32", "stride_qt": "i32", "stride_qh": "i32",
                               "stride_kt": "i32", "stride_kh": "i32", "stride_cs": "i32"},
              dict(HALF=64, BLOCK_HALF=64, INTERLEAVED=interleaved, BLOCK_QH=32, BLOCK_KH=8), num_warps=4)
    build(tf.silu_mul_kernel, {"x_ptr": "*fp16", "out_ptr": "*fp16", "inter": "i32", "stride_x": "i32"},
          dict(BLOCK=1024), num_warps=4)
    print("compiled", count + 4, "of", 28 + len(rows))
""")


def test_engine_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas to assemble for sm_90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 14 paged kernels, 6 RMSNorm forms (plain, e4m3 per token, static; with and without the residual), rope ×2,
    # SiLU·mul, merge, 4 FP8 quantize kernels and one FP8 product per configuration the dispatch rows name
    words = proc.stdout.split()
    assert words[-3] == words[-1] and int(words[-1]) > 28, proc.stdout
