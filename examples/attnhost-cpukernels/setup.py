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


class _Build(BuildExtension.with_options(use_ninja=True)):  # type: ignore[misc]
    """torch's own build (its compiler flags, the C++ standard its headers require included), whose failure ends
    in one line saying what failed and the way out, below the compiler's output."""

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except Exception as exc:
            raise SystemExit(
                f"attnhost-cpukernels: its C++ kernel did not compile against torch {torch.__version__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no message'}); the compiler's "
                "first 'error:' line above says why. Most often the compiler is older than the C++ standard this "
                "torch's headers require (torch adds its -std flag itself): install a newer g++ or clang, or a torch "
                "release this compiler supports"
            ) from exc


sources = ["csrc/bindings.cpp", "csrc/kernel_base.cpp"]
if X86:  # one build per instruction set, picked at run time: the wheel runs on any x86-64
    sources += ["csrc/kernel_avx2.cpp", "csrc/kernel_avx512.cpp"]

setup(
    ext_modules=[
        CppExtension(
            name="_attnhost_cpukernels",
            sources=sources,
            # no -std: torch's BuildExtension adds the C++ standard this torch's headers require
            extra_compile_args=["-O3", "-fopenmp", *(["-DCPUK_X86"] if X86 else [])],
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": _Build},
    install_requires=["attnhost[torch]", f"torch=={torch.__version__.split('+')[0]}"],
)
