"""Variants of the layers step's LM head (decode_layers.cu's decode_head, common.cuh's
lm_head_rows) as edits of the kernel source the backend compiles: rows a warp has in flight
(DL_HEAD_ROWS) and the unrolling of the loop over a row's 16-byte columns (a lane's loads of
several columns in flight at once). Each variant sums every logit in the same order as main
(a lane's columns in order, then warp_sum), so its bits are main's.

    python head_variants.py NAME [OUT.cu]   # write the variant's decode_layers source
"""
import re
import sys
from pathlib import Path

CUDA = Path(__file__).resolve().parents[2] / "src" / "forge_ml" / "backends" / "cuda"
LOOP = "        for (int i = lane; i < nv; i += 32) {\n            uint4 w16[ROWS];"
BOUNDS = "__launch_bounds__(DL_HEAD_WARPS * 32, 2)"
VARIANTS = {   # name: (warps a block, rows a warp, unroll of the column loop (0: none), blocks an SM
               #        the launch bounds ask registers for)
    "main": (16, 8, 0, 2), "w8r8u2": (8, 8, 2, 2), "w8r4u6": (8, 4, 6, 2), "w8r8": (8, 8, 0, 2),
    "w4r8": (4, 8, 0, 2), "w8r16": (8, 16, 0, 2), "w8r8b3": (8, 8, 0, 3), "w16r8b1": (16, 8, 0, 1),
}
# ptxas (NVRTC 12.9, sm_90): main 64 registers (float32 8 bytes of spills), w8r8u2 128 and none,
# w8r4u6 128 and 16 bytes, w8r8 -; w8r8u3 and (16 warps, 8 rows, unroll 3, 1 block an SM)
# spilled 52-60 bytes at 128 and are left out


def source(name: str, text: str = None) -> str:
    """decode_layers.cu with common.cuh pasted in (runtime.kernel_source), edited for ``name``."""
    warps, rows, unroll, blocks = VARIANTS[name]
    if text is None:
        text = (CUDA / "decode_layers.cu").read_text().replace(
            '#include "common.cuh"', (CUDA / "common.cuh").read_text(), 1)
    assert LOOP in text and "#define DL_HEAD_ROWS 8" in text and BOUNDS in text
    text = re.sub(r"#define DL_HEAD_ROWS 8\b", f"#define DL_HEAD_ROWS {rows}", text)
    text = re.sub(r"#define DL_HEAD_WARPS 16\b", f"#define DL_HEAD_WARPS {warps}", text)
    text = text.replace(BOUNDS, f"__launch_bounds__(DL_HEAD_WARPS * 32, {blocks})")
    if unroll:
        text = text.replace(LOOP, f"#pragma unroll {unroll}\n" + LOOP, 1)
    return text


if __name__ == "__main__":
    out = source(sys.argv[1])
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(out)
    else:
        sys.stdout.write(out)
