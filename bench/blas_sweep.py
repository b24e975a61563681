"""cuBLAS against cuBLASLt for the decode step's linear layers (GPU only, ~1 minute): which BLAS path torch's
F.linear takes (`torch.backends.cuda.preferred_blas_library`) at each weight shape and row count, and whether the
two give the same bits.

Usage: python bench/blas_sweep.py [--model qwen3-0.6b|starcoderbase-1b] [--m 1,64,256,1024,16384] [--reps 200]
For each linear of one layer (and the LM head) of the model's shape, bf16, with its biases where the model has
them (StarCoderBase-1B: every projection), each M: microseconds of F.linear (median of --reps, CUDA events around
each call, the host queued ahead behind a sleep kernel; weights rotating through a pool larger than 2x the L2, so
every call streams its weight from HBM, as in a step) under "cublas" (torch's default) and "cublaslt"; with a GELU
after it (StarCoderBase-1B's c_fc) also `torch._addmm_activation(use_gelu=True)` (cuBLASLt's bias + GELU epilogue:
the tanh GELU, one kernel). Then a decode step's linear layers per M (layers x each shape + the LM head) under
each path. "same" says whether cuBLASLt's output equals cuBLAS's bit for bit. On a machine without CUDA it exits
at once saying so."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from gemv_sweep import median_us

POOL_BYTES = 120 * 2**20  # > 2x the 50 MB L2
# name -> (layers, {shape: (N, K)}, bias on the projections, the shape followed by a GELU (or None))
MODELS = {
    "qwen3-0.6b": (28, {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                        "lm_head": (151936, 1024)}, False, None),
    "starcoderbase-1b": (24, {"qkv": (2304, 2048), "o": (2048, 2048), "c_fc": (8192, 2048), "c_proj": (2048, 8192),
                              "lm_head": (49152, 2048)}, True, "c_fc"),
}


def set_blas(name: str) -> None:
    torch.backends.cuda.preferred_blas_library(name)


def timed(path: str, x: torch.Tensor, pool: list, bias: list | None, gelu: bool, reps: int
          ) -> tuple[float, torch.Tensor]:
    set_blas("cublaslt" if path != "cublas" else "cublas")
    if path == "lt-gelu-epilogue":
        def run(i):
            w = pool[i % len(pool)]
            return torch._addmm_activation(bias[i % len(pool)], x, w.t(), use_gelu=True)
    else:
        def run(i):
            y = F.linear(x, pool[i % len(pool)], None if bias is None else bias[i % len(pool)])
            return F.gelu(y, approximate="tanh") if gelu else y
    try:
        return median_us(run, reps), run(0)
    finally:
        set_blas("cublas")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    ap.add_argument("--m", default="1,64,256,1024,16384")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("blas_sweep.py needs a CUDA GPU")
    layers, shapes, has_bias, gelu_shape = MODELS[args.model]
    ms = [int(v) for v in args.m.split(",")]
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"{args.model}: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    times: dict[tuple[int, str, str], float] = {}  # (M, path, shape) -> that shape's us in a step
    for name, (n, k) in shapes.items():
        count = 1 if name == "lm_head" else layers
        size = max(1, -(-POOL_BYTES // (2 * n * k)))
        pool = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(size)]
        bias = [torch.randn(n, device=dev, dtype=dt) for _ in range(size)] if has_bias and name != "lm_head" else None
        paths = ["cublas", "cublaslt"] + (["lt-gelu-epilogue"] if name == gelu_shape else [])
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = None
            for path in paths:
                us, y = timed(path, x, pool, bias, name == gelu_shape, args.reps)
                same = "" if ref is None else ("same" if torch.equal(y, ref) else
                                               f"max|diff| {(y.float() - ref.float()).abs().max().item():.3g}")
                ref = y if ref is None else ref
                tbs = 2 * (n * k + m * k + m * n) / us / 1e6
                print(f"{name:8s} M={m:<5d} {path:16s} {us:9.2f} us {tbs:5.2f} TB/s {same}")
                times[(m, path, name)] = count * us
    epilogue = f"; lt+epilogue: cuBLASLt with the bias + GELU epilogue for {gelu_shape}" if gelu_shape else ""
    print(f"\na step's linear layers ({layers} x each layer shape + the LM head), ms{epilogue}:")
    for m in ms:
        total = {path: sum(v for (mm, p, _), v in times.items() if mm == m and p == path) / 1000
                 for path in ("cublas", "cublaslt")}
        line = f"M={m:<5d} cublas {total['cublas']:.3f} | cublaslt {total['cublaslt']:.3f}"
        if gelu_shape:
            epi = total["cublaslt"] + (times[(m, "lt-gelu-epilogue", gelu_shape)]
                                       - times[(m, "cublaslt", gelu_shape)]) / 1000
            line += f" | lt+epilogue {epi:.3f}"
        print(line)

if __name__ == "__main__":
    main()
