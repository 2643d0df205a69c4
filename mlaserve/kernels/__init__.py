"""Triton kernels, one module per op (launcher `op()`, PyTorch reference `op_ref()`)."""
from mlaserve.kernels.interpreter import install as _install_interpreter

_install_interpreter()            # under TRITON_INTERPRET=1 only: device-function calls without repatching
