"""The dispatch table's Triton kernels compile for Hopper (sm_90) without a GPU.

The CPU interpreter runs the kernels' Python but not Triton's compiler, which rejects some programs
the interpreter accepts (an early `return` under a constexpr `if`, for one). The compile runs in a
subprocess because this folder's conftest turns the interpreter on for the whole test process.
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

    from quantkit.kernels import dispatch
    from quantkit.kernels.triton_gemm import dequant_kernel, gemm_kernel
    from quantkit.kernels.triton_gemv import gemv_kernel

    COMMON = {"x_ptr": "*fp16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*fp16",
              "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
              "K8": "i32", "G": "i32", "stride_xm": "i32", "stride_om": "i32", "SPLIT_K": "i32"}
    DEQUANT = {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*fp16", "N": "i32", "K": "i32",
               "K8": "i32", "G": "i32"}

    def build(fn, signature, constexprs, **options):
        sig = {**signature, **{k: "constexpr" for k in constexprs}}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options=options)

    count = 0
    for bits, rows in dispatch.TABLE.items():
        for _, choice in rows:
            p = choice.params
            if choice.method == "gemv":
                ce = dict(group_size=128, BITS=bits, BLOCK_N=p["block_n"], BLOCKS=p["blocks"], SPLIT=True,
                          HAS_BIAS=True, DENORMAL=True, NUM_STAGES=p.get("num_stages", 1))
                c = build(gemv_kernel, COMMON, ce, num_warps=p["num_warps"], num_stages=ce["NUM_STAGES"])
            elif choice.method == "gemm":
                ce = dict(group_size=128, BITS=bits, BLOCK_M=p["block_m"], BLOCK_N=p["block_n"], BLOCKS=p["blocks"],
                          SPLIT=True, HAS_BIAS=True, SWAP_AB=p["swap_ab"])
                c = build(gemm_kernel, COMMON, ce, num_warps=p["num_warps"], num_stages=p["num_stages"])
            else:
                c = build(dequant_kernel, DEQUANT, dict(group_size=128, BITS=bits, BLOCK_N=32, BLOCKS=16), num_warps=4)
            assert c.asm.get("cubin"), (bits, choice)
            count += 1
    print("compiled", count)
""")


def test_dispatch_table_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode and "ptxas" in proc.stderr.lower() and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas to assemble for sm_90")
    assert proc.returncode == 0, proc.stderr[-3000:]
    n_choices = proc.stdout.split()[-1]
    from quantkit.kernels import dispatch

    assert int(n_choices) == sum(len(rows) for rows in dispatch.TABLE.values())
