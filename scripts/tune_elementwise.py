"""Sweep the elementwise kernel's tile size and warps on the GPU; print GB/s per config.

The heuristic in fuseml/ops/_elementwise.py (TILE_BYTES, NUM_WARPS) was picked from this
sweep. Usage (GPU machine): PYTHONPATH=src python3 scripts/tune_elementwise.py
"""

import torch
import triton
import triton.testing

from fuseml.bench.roofline import COPY_BYTES
from fuseml.ops import _elementwise as ew


def gbps(nbytes, fn):
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    return nbytes / (ms * 1e-3) / 1e9


def main():
    src = torch.empty(COPY_BYTES // 4, device="cuda").uniform_()
    dst = torch.empty_like(src)
    copy = gbps(2 * COPY_BYTES, lambda: dst.copy_(src))
    src = dst = None
    print(f"{torch.cuda.get_device_name()}: copy {copy:,.0f} GB/s")
    gelu = ew.ACT_CODE["gelu"]
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.empty((), dtype=dtype).element_size()
        for shape, has_bias in (
            ((1 << 20,), False), ((1 << 24,), False), ((1 << 28,), False),
            ((65536, 512), True), ((4096, 4096), True), ((65536, 4096), True),
        ):  # fmt: skip
            x = torch.randn(shape, device="cuda", dtype=dtype)
            b = torch.randn(shape[-1], device="cuda", dtype=dtype) if has_bias else None
            out = torch.empty_like(x)
            nbytes = 2 * x.numel() * es
            rows = 1 if len(shape) == 1 else shape[0]
            cols = x.numel() if len(shape) == 1 else shape[1]
            heur = ew.launch_config(rows, cols, es)
            results = []
            for tile_bytes in (4096, 8192, 16384, 32768):
                for warps in (4, 8):
                    tile = tile_bytes // es
                    bn = min(tile, triton.next_power_of_2(cols))
                    bm = max(1, tile // bn) if rows > 1 else 1
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}
                    r = gbps(nbytes, lambda cfg=cfg, out=out, x=x, b=b: ew.bias_act_into(
                        out, x, None, b, 1.0, gelu, config=cfg))  # fmt: skip
                    results.append((r, tile_bytes, warps))
            h = gbps(nbytes, lambda out=out, x=x, b=b: ew.bias_act_into(out, x, None, b, 1.0, gelu))
            best = max(results)
            cells = " ".join(f"{t // 1024}K/{w}w:{r:,.0f}" for r, t, w in results)
            print(
                f"{str(dtype)[6:]:>8} {shape!s:>14} heuristic {heur} -> {h:,.0f} GB/s "
                f"({100 * h / copy:.0f}%); best {best[1] // 1024}K/{best[2]}w "
                f"{best[0]:,.0f} ({100 * best[0] / copy:.0f}%) | {cells}"
            )


if __name__ == "__main__":
    main()
