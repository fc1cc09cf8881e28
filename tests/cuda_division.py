"""CUDA's rule for a division by a Python number, reproduced on the CPU, so that tests without a GPU can
check that code meant to give the same bits on every device does not depend on it.

CUDA's true-division kernel (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``) turns a divisor that
is a CPU scalar -- a Python number, or a one-element CPU tensor -- into a multiplication by its
reciprocal, computed once in the operation's math type (float32 for float32, float16 and bfloat16
tensors). That product is not correctly rounded: ``x * (1 / 7)`` misses ``x / 7`` in the last bit for
about half of all float32 ``x``. The CPU divides (IEEE, correctly rounded), and so does CUDA when the
divisor is a tensor on the GPU. :class:`CudaDivisionRule` makes every division of a float32, float16 or
bfloat16 tensor by a Python number inside it compute what CUDA computes; a division by a tensor is left
alone (on CUDA the code under test makes its divisors on the values' own device: no CPU scalar there).
``tests/engine/test_cuda.py`` checks on a GPU that the rule reproduces CUDA's results.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CudaDivisionRule", "correctly_rounded_quotient"]

_aten = torch.ops.aten
_DIVISIONS = {_aten.div.Tensor, _aten.div.Scalar}
_IN_PLACE = {_aten.div_.Tensor, _aten.div_.Scalar}
_FLOAT32_MATH = (torch.float32, torch.float16, torch.bfloat16)


def correctly_rounded_quotient(values: torch.Tensor, divisor: Any) -> torch.Tensor:
    """``values / divisor`` rounded once to ``values``' dtype: the float64 quotient of two float32 numbers
    is itself rounded to 53 bits, and 53 >= 2 * 24 + 2, so rounding it to float32 gives the correctly
    rounded float32 quotient (no double-rounding error)."""
    return (values.double() / torch.as_tensor(divisor, dtype=torch.float64)).to(values.dtype)


class CudaDivisionRule(TorchDispatchMode):
    """Inside the block, ``tensor / number`` (and ``div``, ``div_``, ``/=``) computes
    ``tensor * float32(1 / number)``, as CUDA does; everything else runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced = 0  # divisions computed by CUDA's rule

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func in _DIVISIONS or func in _IN_PLACE) and len(args) == 2 and not kwargs:
            values, divisor = args
            if (
                isinstance(divisor, (int, float))
                and not isinstance(divisor, bool)
                and isinstance(values, torch.Tensor)
                and values.dtype in _FLOAT32_MATH
            ):
                self.replaced += 1
                one = torch.ones((), dtype=torch.float32)
                reciprocal = one / torch.full((), float(divisor), dtype=torch.float32)
                result = (values.to(torch.float32) * reciprocal).to(values.dtype)
                return values.copy_(result) if func in _IN_PLACE else result
        return func(*args, **kwargs)
