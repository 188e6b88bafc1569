"""Build of the compiled kernel: a torch C++ extension, built against the torch installed in this environment.

Install with ``pip install --no-build-isolation .`` after torch: the extension must be compiled against the very
torch that will import it (its C++ ABI is not stable across releases), and build isolation would fetch another.
The wheel then pins that torch release (``torch==X.Y.Z``), as every torch extension wheel must.
"""

from __future__ import annotations

import platform

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

X86 = platform.machine().lower() in ("x86_64", "amd64")
sources = ["csrc/bindings.cpp", "csrc/kernel_base.cpp"]
if X86:  # one build per instruction set, picked at run time: the wheel runs on any x86-64
    sources += ["csrc/kernel_avx2.cpp", "csrc/kernel_avx512.cpp"]

setup(
    ext_modules=[
        CppExtension(
            name="_attnhost_cpukernels",
            sources=sources,
            extra_compile_args=["-O3", "-fopenmp", "-std=c++17", *(["-DCPUK_X86"] if X86 else [])],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=["attnhost[torch]", f"torch=={torch.__version__.split('+')[0]}"],
)
