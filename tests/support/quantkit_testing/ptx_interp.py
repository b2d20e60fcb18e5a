"""A small interpreter for the PTX that quantkit/kernels/triton_mma.py generates, for the CPU tests.

It runs the asm of one warp: the 32 lanes in lockstep, one instruction at a time (the generated code
is straight-line, with predicated loads), and `mma.sync` m16n8k16 warp-wide from the fragment layout
in the PTX ISA. Memory is a dict of 32-bit words; a load of an address not in it fails the test, so
the asm must never read past what the kernel hands it. Only the instructions the generator emits
are known; anything else fails the test.
"""

from __future__ import annotations

import re

import numpy as np
import torch


def h2f(bits: int, bf16: bool) -> float:
    """An fp16 (or bf16) bit pattern as a float."""
    if bf16:
        return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def f2h(value: float, bf16: bool) -> int:
    """A float rounded to nearest-even fp16 (or bf16), as bits."""
    dtype = torch.bfloat16 if bf16 else torch.float16
    return int(torch.tensor(value, dtype=torch.float64).to(dtype).view(torch.int16)) & 0xFFFF


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


class Warp:
    """32 lanes running `asm`; inputs[lane] are the values of $first_input, $first_input + 1, …"""

    def __init__(self, asm: str, inputs: list[list], memory: dict[int, int], bf16: bool, first_input: int = 8):
        assert len(inputs) == 32
        self.outputs = first_input
        self.code = [ln for ln in (raw.strip().rstrip(";") for raw in asm.splitlines())
                     if ln and ln not in "{}" and not ln.startswith(".reg")]
        self.memory, self.bf16 = memory, bf16
        self.regs = [{f"${first_input + i}": v for i, v in enumerate(lane)} for lane in inputs]

    @staticmethod
    def val(r: dict, tok: str):
        tok = tok.strip()
        if tok in r:
            return r[tok]
        if tok.startswith("0f"):
            return float(np.array([int(tok[2:], 16)], dtype=np.uint32).view(np.float32)[0])
        return int(tok, 0)

    def run(self) -> list[list[float]]:
        for line in self.code:
            if line.startswith("mma.sync"):
                self.mma(line)
                continue
            pred = None
            if line.startswith("@"):
                pred, line = line[1:].split(" ", 1)
            op, _, rest = line.partition(" ")
            for r in self.regs:
                if pred is None or r[pred]:
                    self.execute(r, op, rest)
        return [[r.get(f"${i}") for i in range(self.outputs)] for r in self.regs]

    def execute(self, r: dict, op: str, rest: str) -> None:
        v = lambda tok: self.val(r, tok)  # noqa: E731
        if op.startswith("ld.global"):
            dst, base, off = re.fullmatch(r"\{([^}]*)\},\s*\[([^+\]]+)(?:\+(\d+))?\]", rest).groups()
            addr = v(base) + int(off or 0)
            for i, name in enumerate(dst.split(",")):
                r[name.strip()] = self.memory[addr + 4 * i]
            return
        if op.startswith("mov.") and rest.startswith("{"):  # unpack: mov.b32 {lo, hi}, src
            dst, src = re.fullmatch(r"\{([^}]*)\},\s*(\S+)", rest).groups()
            lo, hi = (d.strip() for d in dst.split(","))
            r[lo], r[hi] = v(src) & 0xFFFF, (v(src) >> 16) & 0xFFFF
            return
        args = [a.strip() for a in rest.split(",")]
        if op == "setp.gt.s32":
            r[args[0]] = v(args[1]) > v(args[2])
        elif op.startswith("mov."):
            r[args[0]] = v(args[1])
        elif op == "and.pred":
            r[args[0]] = v(args[1]) and v(args[2])
        elif op == "mul.lo.s64":
            r[args[0]] = v(args[1]) * v(args[2])
        elif op == "mad.lo.s64":
            r[args[0]] = v(args[1]) * v(args[2]) + v(args[3])
        elif op == "add.s64":
            r[args[0]] = v(args[1]) + v(args[2])
        elif op == "sub.s32":
            r[args[0]] = v(args[1]) - v(args[2])
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            halves = [[(v(a) >> (16 * hi)) & 0xFFFF for a in args[1:4]] for hi in range(2)]
            bf = op == "fma.rn.bf16x2"
            r[args[0]] = sum(f2h(h2f(a, bf) * h2f(b, bf) + h2f(c, bf), bf) << (16 * hi)
                             for hi, (a, b, c) in enumerate(halves))
        elif op == "shr.b32":
            r[args[0]] = (v(args[1]) & 0xFFFFFFFF) >> v(args[2])
        elif op == "shl.b32":
            r[args[0]] = (v(args[1]) << v(args[2])) & 0xFFFFFFFF
        elif op == "or.b32":
            r[args[0]] = (v(args[1]) | v(args[2])) & 0xFFFFFFFF
        elif op == "lop3.b32":
            assert args[4] == "0xEA"  # (a & b) | c
            r[args[0]] = ((v(args[1]) & v(args[2])) | v(args[3])) & 0xFFFFFFFF
        elif op == "prmt.b32":
            r[args[0]] = prmt(v(args[1]) & 0xFFFFFFFF, v(args[2]) & 0xFFFFFFFF, v(args[3]))
        elif op == "cvt.f32.f16":
            r[args[0]] = h2f(v(args[1]), False)
        elif op == "fma.rn.f32":
            r[args[0]] = float(np.float32(v(args[1])) * np.float32(v(args[2])) + np.float32(v(args[3])))
        else:
            raise AssertionError(f"interpreter lacks {op}")

    def mma(self, line: str) -> None:
        d, a, b, c = ([t.strip() for t in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", line))
        A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        frag = [(0, 0), (0, 1), (8, 0), (8, 1)]  # C/D: (row offset, column offset) of register r
        for lane, r in enumerate(self.regs):
            g, t = divmod(lane, 4)
            av = [self.val(r, x) for x in a]
            for i, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
                A[row, col] = h2f(av[i] & 0xFFFF, self.bf16)
                A[row, col + 1] = h2f(av[i] >> 16, self.bf16)
            bv = [self.val(r, x) for x in b]
            for i, row in enumerate([2 * t, 2 * t + 8]):
                B[row, g] = h2f(bv[i] & 0xFFFF, self.bf16)
                B[row + 1, g] = h2f(bv[i] >> 16, self.bf16)
            for i, (dr, dc) in enumerate(frag):
                C[g + dr, 2 * t + dc] = self.val(r, c[i])
        D = (A @ B + C).astype(np.float32)
        for lane, r in enumerate(self.regs):
            g, t = divmod(lane, 4)
            for i, (dr, dc) in enumerate(frag):
                r[d[i]] = float(D[g + dr, 2 * t + dc])


class TensorMemory:
    """The bytes of some CPU tensors as 32-bit little-endian words at their data pointers, for a Warp
    run on addresses a Triton kernel computed; any other address fails the test."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.ranges = []
        for t in tensors:
            assert t.device.type == "cpu" and t.is_contiguous()
            data = t.view(torch.uint8).reshape(-1).numpy()
            self.ranges.append((t.data_ptr(), t.data_ptr() + data.size, data))

    def __getitem__(self, addr: int) -> int:
        for lo, hi, data in self.ranges:
            if lo <= addr and addr + 4 <= hi:
                return int.from_bytes(data[addr - lo:addr - lo + 4].tobytes(), "little")
        raise AssertionError(f"the asm read {addr:#x}, outside every tensor it was given")


def run_inline_asm(asm: str, constraints: str, args: list[np.ndarray], memory: TensorMemory) -> list[np.ndarray]:
    """What `tl.inline_asm_elementwise(asm, constraints, args, pack=1)` computes for a program whose
    elements are its threads (element e is lane e % 32 of warp e // 32), with the generated GEMV asm run
    warp by warp. The PDL and prefetch snippets have no effect on the CPU and return zeros."""
    cons = constraints.split(",")
    n_out = sum(c.startswith("=") for c in cons)
    size = args[0].size
    if "griddepcontrol" in asm or "prefetch.global" in asm:
        return [np.zeros(size, dtype=np.int32) for _ in range(n_out)]
    assert size % 32 == 0 and len(args) == len(cons) - n_out
    columns = []
    for c, a in zip(cons[n_out:], args):
        a = np.broadcast_to(a, (size,))
        columns.append([int(v) for v in a.view(np.uint16)] if c == "h" else
                       [float(v) for v in a] if c == "f" else [int(v) for v in a])
    bf16 = ".bf16.bf16." in asm
    outs = [np.zeros(size, dtype=np.float32) for _ in range(n_out)]
    for w in range(size // 32):
        lanes = [[col[32 * w + i] for col in columns] for i in range(32)]
        res = Warp(asm, lanes, memory, bf16, first_input=n_out).run()
        for i in range(32):
            for j in range(n_out):
                outs[j][32 * w + i] = res[i][j]
    return outs
