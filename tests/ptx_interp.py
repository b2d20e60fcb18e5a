"""A small interpreter for the PTX that quantkit/kernels/triton_mma.py generates, for the CPU tests.

It runs one program (CTA) of several warps, interleaving the warps one instruction at a time so that
shared-memory slots two warps would both use get overwritten. Lanes of a warp run in lockstep (the
generated code branches uniformly; divergence is an error). `mma.sync` m16n8k16 is done warp-wide
from the fragment layout in the PTX ISA. `cp.async` copies are held back until a `cp.async.wait_group`
forces their group to complete — the latest the hardware may deliver them — so reading a slot too
early, or refilling one that is still to be read, shows up as wrong or missing data.
Only the instructions the generators emit are known; anything else fails the test.
"""

from __future__ import annotations

import re

import numpy as np
import torch

SHARED_BASE = 0x10000


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


def _parse(asm: str) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """Instructions, label → index, shared symbol → address."""
    code, labels, shared = [], {}, {}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        if line.startswith(".shared"):
            name = re.search(r"(\w+)\[\d+\]$", line).group(1)
            shared[name] = SHARED_BASE
            continue
        if line.endswith(":"):
            labels[line[:-1]] = len(code)
            continue
        code.append(line)
    return code, labels, shared


class Cta:
    """One program of `warps` warps running `asm`; inputs[thread] are the values of $first_input, …"""

    def __init__(self, asm: str, inputs: list[list], memory: dict[int, int], bf16: bool, first_input: int = 8):
        self.outputs = first_input
        self.code, self.labels, self.symbols = _parse(asm)
        self.memory, self.bf16 = memory, bf16
        self.shared: dict[int, int] = {}
        threads = len(inputs)
        assert threads % 32 == 0
        self.regs = [{f"${first_input + i}": v for i, v in enumerate(inputs[tid])} for tid in range(threads)]
        for tid, r in enumerate(self.regs):
            r["%tid.x"] = tid
        self.pending = [[] for _ in range(threads)]  # per thread: committed groups of (dst, words)
        self.current = [[] for _ in range(threads)]  # copies issued since the last commit

    def val(self, r: dict, tok: str):
        tok = tok.strip()
        if tok in r:
            return r[tok]
        if tok in self.symbols:
            return self.symbols[tok]
        if tok.startswith("0f"):
            return float(np.array([int(tok[2:], 16)], dtype=np.uint32).view(np.float32)[0])
        return int(tok, 0)

    def addr(self, r: dict, text: str) -> int:
        base, off = re.fullmatch(r"\[([^+\]]+)(?:\+(\d+))?\]", text.strip()).groups()
        return self.val(r, base) + int(off or 0)

    def run(self) -> list[list[float]]:
        warps = len(self.regs) // 32
        pcs = [0] * warps
        while any(pc < len(self.code) for pc in pcs):
            for w in range(warps):
                if pcs[w] < len(self.code):
                    pcs[w] = self.step(w, pcs[w])
        return [[r.get(f"${i}") for i in range(self.outputs)] for r in self.regs]

    def step(self, warp: int, pc: int) -> int:
        line = self.code[pc]
        lanes = range(32 * warp, 32 * warp + 32)
        if line.startswith("mma.sync"):
            self.mma(line, lanes)
            return pc + 1
        pred = None
        if line.startswith("@"):
            pred, line = line[1:].split(" ", 1)
        op, _, rest = line.partition(" ")
        active = [tid for tid in lanes if pred is None or self.regs[tid][pred]]
        if op.startswith("bra"):
            assert len(active) in (0, 32), "divergent branch"
            return self.labels[rest.strip()] if active else pc + 1
        for tid in active:
            self.execute(tid, op, rest)
        return pc + 1

    def execute(self, tid: int, op: str, rest: str) -> None:
        r = self.regs[tid]
        v = lambda tok: self.val(r, tok)  # noqa: E731
        if op.startswith(("ld.global", "ld.shared")):
            dst, src = re.fullmatch(r"\{([^}]*)\},\s*(\[.*\])", rest).groups()
            mem = self.memory if op.startswith("ld.global") else self.shared
            base = self.addr(r, src)
            for i, name in enumerate(dst.split(",")):
                r[name.strip()] = mem[base + 4 * i]
            return
        if op.startswith("cp.async."):
            if op == "cp.async.commit_group":
                self.pending[tid].append(self.current[tid])
                self.current[tid] = []
            elif op == "cp.async.wait_group":
                while len(self.pending[tid]) > int(rest):
                    for dst, words in self.pending[tid].pop(0):
                        for i, word in enumerate(words):
                            self.shared[dst + 4 * i] = word
            else:
                dst, src, size = [a.strip() for a in re.fullmatch(r"(\[[^\]]*\]),\s*(\[[^\]]*\]),\s*(\d+)", rest).groups()]
                d, s = self.addr(r, dst), self.addr(r, src)
                assert d % int(size) == 0 and s % int(size) == 0, "misaligned cp.async"
                self.current[tid].append((d, [self.memory[s + 4 * i] for i in range(int(size) // 4)]))
            return
        args = [a.strip() for a in re.split(r",(?![^{]*\})", rest)]
        kind = op.split(".")[0]
        if op.startswith("setp."):
            cmp = op.split(".")[1]
            a, b = v(args[1]), v(args[2])
            r[args[0]] = {"gt": a > b, "lt": a < b, "le": a <= b, "ge": a >= b, "eq": a == b}[cmp]
        elif op == "mov.b32" and args[0].startswith("{"):
            lo, hi = [t.strip() for t in args[0][1:-1].split(",")]
            word = v(args[1]) & 0xFFFFFFFF
            r[lo], r[hi] = word & 0xFFFF, word >> 16
        elif kind == "mov":
            r[args[0]] = v(args[1])
        elif op in ("and.pred",):
            r[args[0]] = v(args[1]) and v(args[2])
        elif op == "mul.lo.s64":
            r[args[0]] = v(args[1]) * v(args[2])
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            halves = [[(v(a) >> (16 * hi)) & 0xFFFF for a in args[1:4]] for hi in range(2)]
            bf = op == "fma.rn.bf16x2"
            r[args[0]] = sum(f2h(h2f(a, bf) * h2f(b, bf) + h2f(c, bf), bf) << (16 * hi)
                             for hi, (a, b, c) in enumerate(halves))
        elif op in ("add.u32", "add.s32", "add.s64"):
            r[args[0]] = v(args[1]) + v(args[2])
        elif op == "sub.s32":
            r[args[0]] = v(args[1]) - v(args[2])
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

    def mma(self, line: str, lanes: range) -> None:
        d, a, b, c = ([t.strip() for t in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", line))
        A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
        frag = [(0, 0), (0, 1), (8, 0), (8, 1)]  # C/D: (row offset, column offset) of register r
        for lane in range(32):
            r = self.regs[lanes[lane]]
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
        for lane in range(32):
            g, t = divmod(lane, 4)
            for i, (dr, dc) in enumerate(frag):
                self.regs[lanes[lane]][d[i]] = float(D[g + dr, 2 * t + dc])
