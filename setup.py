"""The package's optional compiled parts: C extensions built at install when a C compiler is there (each
`optional`: where one cannot be built, the install goes on and the same work is done by pyarrow and numpy).
It also ships the repository's manifests/ inside the wheel. Everything else about the package is in
pyproject.toml."""

import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class build_py_with_manifests(build_py):
    """Copies manifests/ (the default, the labs, the embedded corpus and tokenizer) into the built package as
    disttrace/_manifests, where disttrace.config.manifest.manifests_dir() finds it in an installed wheel.

    A copy at build time, not package-data: manifests/ stays at the repository root, where users read and
    edit it, and is no Python package, so declaring it as package data would need a package-dir mapping of
    a folder of data (and its data/ folders) into disttrace. An editable install copies nothing: it reads
    the checkout's manifests/ in place."""

    def run(self):
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "disttrace" / "_manifests"
        # an earlier build's copy goes first, so a file removed from manifests/ leaves the wheel too
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(HERE / "manifests", target)


# -ffp-contract=off: no fused multiply-add where the source has a multiply and an add (the comparison must give
# numpy's bits on every machine, aarch64 included, where GCC would contract them by default)
ARGS = (
    []
    if sys.platform == "win32"
    else ["-O2", "-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"]
)

setup(
    cmdclass={"build_py": build_py_with_manifests},
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
        Extension(
            "disttrace.native._updates",
            ["disttrace/native/updates.c"],
            extra_compile_args=ARGS,
            optional=True,
        ),
    ],
)
