"""nn.Linear with CPU fast paths for the few rows of a decode or verify step (model.py's projections).

The fast path sits beside the plain one as the CPU's attention (kv_mirror.py) sits beside the
reference: the same math on other kernels, selected by device and dtype, tested against the product
in float64 (tests/test_model.py).
"""
from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear with CPU fast paths for inference on the few rows of a decode or verify step.

    torch's plain CPU F.linear (x @ W.T) reads the weight in a way that suits large batches; for a
    few rows it is much slower than it could be, and its time jumps about with the row
    count. oneDNN on a copy of W packed once into its blocked layout (torch.ops.mkldnn, what
    torch.compile's CPU freezing uses) is the fastest from 3 rows, and for 1-2 rows too where torch
    runs AVX-512 kernels; on a CPU without them W @ x.T (one row padded to two) is faster there
    (FEW_ROWS_BY_MKL). Same math, other kernels; the measurements are in docs/performance.md.
    bfloat16 takes the packed copy too where the CPU multiplies bfloat16 natively (AVX-512 BF16):
    there it reads half the bytes and runs twice the products per instruction (FAST_DTYPES).

    The packed copy (as much memory again as the weight) is made on first use and remade when the
    weight changes (a new tensor or an in-place update moves the key); the weight stays the
    parameter (state_dict, training and the GPU see a plain nn.Linear). Anything that needs a
    gradient, other dtypes and devices take F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype or x.dtype not in FAST_DTYPES or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return super().forward(x)
        n = x.shape[0]   # (not len(x): Tensor.__len__ runs Python code, in a hot path)
        if x.dim() == 2 and n <= 2 and FEW_ROWS_BY_MKL and x.dtype == torch.float32:
            # rows row-major, so that rows.T is the transposed view MKL multiplies fast (not W @ a
            # row-major [K, 2]); one row is padded by cat, a single op
            rows = x.contiguous() if n == 2 else torch.cat([x, x])
            out = (self.weight @ rows.T).T[:n]
            return out if self.bias is None else out + self.bias
        if not PACKED_LINEAR:
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")

    def packed_weight(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if getattr(self, "_packed", (None,))[0] != key:
            with torch.inference_mode(False), torch.no_grad():   # a normal tensor, usable in any mode
                self._packed = key, torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        return self._packed[1]


PACKED_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# the dtypes of the fast paths (the others take F.linear): bfloat16 where the CPU multiplies it natively
NATIVE_BF16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
FAST_DTYPES = (torch.float32, torch.bfloat16) if NATIVE_BF16 else (torch.float32,)
# 1-2 rows by MKL's W @ x.T, not the packed copy: where torch's CPU kernels are AVX2 (or less)
FEW_ROWS_BY_MKL = not (PACKED_LINEAR and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
