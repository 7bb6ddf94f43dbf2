"""The package's optional compiled parts: C extensions built at install when a C compiler is there (each
`optional`: where one cannot be built, the install goes on and the same work is done by numba, where the `fast`
extra is installed, or by pyarrow and numpy). Everything else about the package is in pyproject.toml."""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-add where the source has a multiply and an add (the comparison must give
# numpy's bits on every machine, aarch64 included, where GCC would contract them by default)
ARGS = (
    []
    if sys.platform == "win32"
    else ["-O2", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"]
)

setup(
    ext_modules=[
        Extension(
            "disttrace.native._blockdecode",
            ["disttrace/native/blockdecode.c"],
            extra_compile_args=ARGS,
            optional=True,
        ),
        Extension(
            "disttrace.native._compare",
            ["disttrace/native/compare.c"],
            extra_compile_args=ARGS,
            optional=True,
        ),
    ]
)
