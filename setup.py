"""The package's native part: the torch C++ extension ``torchrec_dtensor_bridge._C`` (its ops:
``torch.ops.tdb_native``), built by the package build.

Everything else about the package is in ``pyproject.toml``. Steps of the build (``pip install
--no-build-isolation .``, or ``-e .`` for a checkout, as ``make setup`` runs it):

1. ``build_clib``: the C kernels (``csrc/*.c``) compiled as C11 into a static library. C11, not the C++
   the extension is written in: the kernels' bits depend on every multiply-add being rounded where it is
   written, which ISO C mode guarantees (no implicit contraction into fused multiply-adds).
2. ``build_ext``: ``csrc/ops.cpp`` (the ops over tensors, registered with ``TORCH_LIBRARY``) compiled
   against the installed torch by ``torch.utils.cpp_extension.BuildExtension`` and linked with that library
   into ``torchrec_dtensor_bridge/_C*.so`` (in place for an editable install).

The extension is built for the torch it is built against: build without isolation, in the environment that
will import it (an isolated build would fetch another torch).
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = Path("torchrec_dtensor_bridge") / "csrc"
C_SOURCES = sorted(str(p) for p in CSRC.glob("*.c"))
C_FLAGS = ["-O3", "-std=c11", "-fno-wrapv", "-g0", "-fvisibility=hidden"]
"""-fno-wrapv and -g0 undo Python's own CFLAGS (-fwrapv -g), which the C compiler is given first; the kernels'
symbols stay inside the extension (hidden)."""

setup(
    libraries=[("tdb_kernels", {"sources": C_SOURCES, "cflags": C_FLAGS, "include_dirs": [str(CSRC)]})],
    ext_modules=[
        CppExtension("torchrec_dtensor_bridge._C", [str(CSRC / "ops.cpp")], include_dirs=[str(CSRC)],
                     extra_compile_args=["-O3", "-g0"]),
    ],
    cmdclass={"build_ext": BuildExtension},
)
