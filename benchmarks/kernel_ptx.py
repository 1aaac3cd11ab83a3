"""What the `linear_scan` Triton kernels compile to for a GPU, on any machine (no GPU needed).

    python benchmarks/kernel_ptx.py                 # sm_90 (H100), fp32 and bf16, forward and backward
    python benchmarks/kernel_ptx.py --arch 80 --num-warps 8
    python benchmarks/kernel_ptx.py --reverse-tiles both   # also the falling-address reverse order

Triton compiles for a target without a device (its LLVM and ptxas ship in the wheel). For each
variant of `_scan_kernel` this prints the widths of the global loads and stores in the PTX
(`v1.b32` is one 32-bit element per thread and instruction, `v4.b32` four: vectorized), the
registers per thread, barriers and spills `ptxas -v` reports, the `bar.sync` instructions in the
PTX, and the register layout of the [BLOCK_C, BLOCK_T] tile. `--reverse-tiles` picks the
reverse-order variants compiled (the private knob `Knobs.reverse_tiles`: `rising`, the
launcher's default, `falling`, or `both`); the time-order variants are the same for both and
compiled once. Speed needs a GPU (`benchmarks/linear_scan.py`); this says what the code is, for
kernel work on a machine without one. Written against Triton 3.6's compile API (`ASTSource`,
`GPUTarget`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tfun.kernels import _linear_scan_triton as K

POINTERS = ("A", "B", "H0", "CARRY", "OUT", "HPREV", "DA")
#: the integer arguments equal to 1 for a (channels, time) tensor scanned along time, which
#: Triton's launcher turns into constants: the unit strides and INNER (one channel per row)
UNIT_ARGS = ("INNER", "sa_t", "sb_t", "so_t", "sa_i", "sb_i", "sh0_i", "so_i")
#: the previous-state strides, 1 in the backward (the forward passes zeros)
BWD_UNIT_ARGS = ("sp_t", "sp_i")


def compile_scan(dtype: str, bwd: bool, reverse: bool, arch: int, num_warps: int, rising: bool = False) -> object:
    """`_scan_kernel` as the launcher specializes it for a (channels, time) tensor scanned along
    its last, contiguous axis (the benchmark's layout): the arguments equal to 1 are constants,
    the other integers divisible by 16 (T = 4096). `reverse` is the kernel's processing order:
    the backward of a forward scan runs in reverse order; `rising` (with `reverse` only, as the
    launcher passes it) loads the reverse-order tiles at rising addresses."""
    if rising and not reverse:
        raise ValueError("the rising-address variant exists only in reverse order")
    names = list(inspect.signature(K._scan_kernel).parameters)
    consts = {
        "REVERSE": reverse, "RISING": rising, "SHIFT": (1 if reverse else -1) if bwd else 0, "BWD": bwd, "ACC_F64": False,
        "BLOCK_C": K.MAX_BLOCK_C, "BLOCK_T": K.MAX_BLOCK_T, **{n: 1 for n in UNIT_ARGS + (BWD_UNIT_ARGS if bwd else ())},
    }  # fmt: skip
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in POINTERS:
            sig[n] = "*fp32" if n == "CARRY" else "*" + dtype
        else:
            sig[n] = "i32"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in consts}
    src = ASTSource(fn=K._KERNELS["scan"][False], signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def widths(ptx: str, op: str) -> str:
    """`v4.b32 x8, v1.b16 x2`: the static count of each vector width of `op.global` (`ld`/`st`)."""
    found = []
    for suffixes in re.findall(r"\b" + op + r"\.global((?:\.[\w:]+)+)", ptx):
        parts = suffixes.split(".")
        vec = next((p for p in parts if re.fullmatch(r"v\d", p)), "v1")
        found.append(vec + "." + next(p for p in reversed(parts) if re.fullmatch(r"[bfsu]\d+", p)))
    return ", ".join(f"{k} x{v}" for k, v in sorted(Counter(found).items()))


def barriers(ptx: str) -> int:
    """The `bar.sync` / `barrier.sync` instructions in the PTX (static count)."""
    return len(re.findall(r"^\s*(?:bar|barrier)\.sync\b", ptx, re.M))


def ptxas(ptx: str, arch: int) -> str:
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([exe, "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}", f.name, "-o", os.devnull],
                             capture_output=True, text=True)  # fmt: skip
    finally:
        os.unlink(f.name)
    lines = [ln.split("ptxas info    :")[-1].strip() for ln in (out.stdout + out.stderr).splitlines() if "registers" in ln or "spill" in ln]
    return "; ".join(lines) or (out.stderr.strip().splitlines() or ["ptxas gave nothing"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100)")
    ap.add_argument("--num-warps", type=int, default=4, help="as the launcher uses (4)")
    ap.add_argument("--reverse-tiles", choices=("falling", "rising", "both"), default="rising",
                    help="the reverse-order variants to compile (Knobs.reverse_tiles; default: rising, the launcher's)")  # fmt: skip
    args = ap.parse_args(argv)
    tiles = {"falling": (False,), "rising": (True,), "both": (False, True)}[args.reverse_tiles]
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.num_warps} warps, BLOCK_C={K.MAX_BLOCK_C}, BLOCK_T={K.MAX_BLOCK_T}")
    print("| kernel | dtype | global loads | global stores | ptxas -v (a barrier: a layout change through shared memory) | bar.sync in the PTX |")
    print("|---|---|---|---|---|---:|")
    layout = None
    for dtype in ("fp32", "bf16"):
        for bwd, reverse in ((False, False), (False, True), (True, True), (True, False)):
            for rising in tiles if reverse else (False,):
                k = compile_scan(dtype, bwd, reverse, args.arch, args.num_warps, rising)
                ptx = k.asm["ptx"]  # type: ignore[attr-defined]
                name = ("backward" if bwd else "forward") + (" in reverse order" if reverse else " in time order")
                if reverse:
                    name += ", rising tiles" if rising else ", falling tiles"
                print(f"| {name} | {dtype} | {widths(ptx, 'ld')} | {widths(ptx, 'st')} | {ptxas(ptx, args.arch)} | {barriers(ptx)} |", flush=True)
            layout = layout or next((ln for ln in k.asm["ttgir"].splitlines() if ln.startswith("#blocked")), None)  # type: ignore[attr-defined]
    print(f"\ntile layout: {layout}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
