"""Builds native/ into adaptive_llama/kernel/_adaptive_native*.so: the llama.cpp samplers (reached
through ctypes) and the array API as a CPython function (native/module.c).

The library is optional: without a C compiler the package still installs and the numba
kernel runs (the package says so at import). The compile flags let GCC vectorise the passes
(the kernel's own expf, and log/log1p/exp through glibc's vector math library) and split the
passes over every token among threads (OpenMP); -march=native because the library is built
on the machine that runs it, with a portable fallback when the compiler refuses it; 512-bit
vectors where the CPU has them (-march=native alone prefers 256 bits on AVX-512 machines: the
kernel then took 1.25x as long at V 262,144). -ffast-math is for compiling only: linked with
it, GCC would add crtfastmath.o, which flushes subnormal numbers to zero in the whole process.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAG_SETS = [
    ["-O3", "-ffast-math", "-march=native", "-mprefer-vector-width=512"],
    ["-O3", "-ffast-math"],
]
# OpenMP splits the passes over every token among host threads (libgomp, the pool llama.cpp's
# CPU backend uses too); a compiler without it (Apple's clang) builds the kernel without.
OPENMP = ["-fopenmp"]


class BuildNative(build_ext):
    def build_extension(self, ext):
        errors = []
        for flags in [f + OPENMP for f in FLAG_SETS] + FLAG_SETS:
            ext.extra_compile_args = flags + ["-std=c11", "-fvisibility=hidden"]
            ext.extra_link_args = OPENMP if OPENMP[0] in flags else []
            try:
                print(f"building {ext.name} with {' '.join(flags)}")
                return super().build_extension(ext)
            except Exception as exc:  # a compiler that rejects these flags: try the next set
                errors.append(f"{' '.join(flags)}: {exc}")
        print("WARNING: the C kernel did not build; the numba kernel will run instead.\n  "
              + "\n  ".join(errors))


setup(
    ext_modules=[
        Extension(
            "adaptive_llama.kernel._adaptive_native",
            sources=["native/adaptive.c", "native/module.c"],
            depends=["native/adaptive.h"],
            libraries=["mvec", "m"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
