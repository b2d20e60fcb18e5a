"""The dispatch's Triton kernels compile for Hopper (sm_90) without a GPU: the block-planar table's,
and every configuration `mma_choice` picks for the tensor-core GEMV (whose inline PTX is assembled by
ptxas here, the only place in CI where it is).

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
    for bits in (4, 8):
        for _, choice in dispatch.TABLE[f"w{bits} block-planar"]:
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

    from quantkit.kernels import triton_mma
    MMA = {"x_addr": "i64", "w_addr": "i64", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*fp16",
           "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "KW": "i32",
           "G": "i32", "RT": "i32", "SPLIT_K": "i32", "stride_xm": "i32", "stride_om": "i32"}
    seen = set()
    pdl_seen = False
    for bits in (4, 8):
        for m in (1, 8, 16, 32, 64):
            cols = -(-m // 8)
            for n in (4096, 12288, 22016):
                c = dispatch.mma_choice(bits, m, n)
                key = (bits, cols, tuple(sorted(c.params.items())))
                if key in seen:
                    continue
                seen.add(key)
                p = c.params
                for bf16, even_k in ((False, True), (bits == 4, False)):
                    rows = p.get("rows", 1)
                    asm, cons = triton_mma.asm_for(bits, cols, bf16, even_k, p["tiles"], rows)
                    ce = dict(group_size=128, ASM=asm, CONS=cons, BITS=bits, COLS=cols, NW=p["num_warps"],
                              TILES=p["tiles"], HAS_BIAS=True, ROWS=rows, WR=p.get("warps_n", 1),
                              SPLIT=p.get("split_k", 1) > 1, PDL=p.get("pdl", False), PREFETCH=p.get("prefetch", 0))
                    opts = {"maxnreg": p["maxnreg"]} if p.get("maxnreg") else {}
                    out = build(triton_mma.mma_gemv_kernel, MMA, ce, num_warps=p["num_warps"], **opts)
                    assert out.asm.get("cubin"), (bits, m, p)
                    assert out.asm["ptx"].count("mma.sync") == 8 * cols * p["tiles"] * rows
                    assert out.asm["ptx"].count("griddepcontrol.wait") == int(p.get("pdl", False))
                    pdl_seen |= p.get("pdl", False)
    for bits in (4, 8):
        d = build(triton_mma.dequant_mma_kernel, {"w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
                  "out_ptr": "*fp16", "N": "i32", "K": "i32", "KW": "i32", "G": "i32"},
                  dict(group_size=128, BITS=bits, TILES=2), num_warps=4)
        assert d.asm.get("cubin")
    assert pdl_seen and not any(dispatch.mma_choice(4, m, 4096, pdl=False).params.get("pdl") for m in (1, 16, 64))
    print("mma configurations", len(seen))
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

    assert int(n_choices) == sum(len(dispatch.TABLE[f"w{bits} block-planar"]) for bits in (4, 8))


GLUON_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from quantkit.kernels import dispatch, gluon_gemm as gg

    names = list(gg.gemm_kernel.arg_names)


    def check(bm, stages, rows, split, bits):
        w_box, w_layout = gg.w_box(rows, bits)
        sig = {"x_desc": f"tensordesc<fp16[{bm}, 128],{gg._X_LAYOUT!r}>",
               "w_desc": f"tensordesc<i32{w_box},{w_layout!r}>", "s_ptr": "*fp16",
               "z_ptr": "*u8", "b_ptr": "*fp16", "out_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
               "M": "i32", "N": "i32", "KT": "i32", "G": "i32"}
        load_l, words_l = gg.words_layouts(rows, bits)
        ce = dict(group_size=128, BM=bm, STAGES=stages, ROWS=rows, HAS_BIAS=True, SPLIT=split, BITS=bits,
                  load_l=load_l, words_l=words_l)
        sig.update({name: "constexpr" for name in ce})
        attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("s_ptr", "z_ptr", "out_ptr", "N")}
        # the W8 word tile and both A operands are relabellings the compiler must prove free of data
        # movement (convert_layout(assert_trivial=True)), or compilation fails here
        out = triton.compile(GluonASTSource(fn=gg.gemm_kernel, signature=sig, constexprs=ce, attrs=attrs),
                             target=GPUTarget("cuda", 90, 32), options=dict(num_warps=rows // 16))
        ptx = out.asm["ptx"]
        what = (bm, stages, rows, split, bits)
        bodies = 3
        assert out.asm.get("cubin"), what
        # the words arrive as one TMA message per slot, row-major as `_words` reads them: a box the
        # compiler splits (wider than 256) lands as stacked messages (the W8 bug of run 67)
        assert out.metadata.tensordesc_meta[1]["block_size"] == w_box, (what, out.metadata.tensordesc_meta)
        # one m64nBMk16 per 16 inputs of the 128-input tile, in each of the K loop's three step bodies
        # (two per iteration, so that consecutive A operands are different registers, and the tail)
        assert ptx.count("wgmma.mma_async") == bodies * 8, what
        # x and words: the ring's prologue and each step body's refill (the tail step refills nothing,
        # which the compiler can prove with two slots, and then drops its copies)
        assert ptx.count("cp.async.bulk.tensor") in (2 * (stages - 1) + bodies * 2, 2 * (stages - 1) + 2 * 2), what
        # the dequantized weights never go through shared memory (one st.shared: the split-K count,
        # handed by the thread that took it to the others)
        assert ptx.count("st.shared") == (split > 1), what
        # split K: one arrival per program (acquire-release, GPU scope), its partial sums read from L2
        assert ptx.count("atom.global.gpu.acq_rel.add") == (split > 1), what
        assert ("ld.global.cg" in ptx) == (split > 1), what
        # the dequantization: one lop3 (W4) or prmt (W8) per fp16 pair, 32 pairs per thread in each step body
        op, other = ("lop3.b32", "prmt.b32") if bits == 4 else ("prmt.b32", "lop3.b32")
        assert ptx.count(op) == bodies * 32 and other not in ptx, what


    seen = set()
    for bits in (4, 8):
        for m in range(17, 1025):
            for k, n in ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)):
                c = dispatch.gluon_choice(m, n, k, bits=bits)
                if c is None or (bits, *c.params.values()) in seen:
                    continue
                seen.add((bits, *c.params.values()))
                check(c.params["bm"], c.params["stages"], c.params["rows"], c.params.get("split", 1), bits)
    print("gluon configurations", len(seen))
""")


def test_gluon_gemm_compiles_for_hopper():
    # every configuration the dispatch picks for the Gluon GEMM, with this Triton's Gluon (CI: 3.9; the
    # lent GPU: 3.6 — the module papers over the renamed calls)
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", GLUON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from quantkit.kernels import dispatch

    picked = {(bits, *c.params.values()) for bits in (4, 8) for m in range(17, 1025) for k, n in
              ((4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096))
              if (c := dispatch.gluon_choice(m, n, k, bits=bits)) is not None}
    assert len({p for p in picked if p[0] == 8}) >= 4 and int(proc.stdout.split()[-1]) == len(picked)
