"""ls-fairseq: a fairseq --user-dir plugin with fused CUDA kernels for Transformer NMT training.

`pip install .` (editable or not) ships the CUDA sources of `csrc/` inside the package
(`ls_fairseq/csrc/`), so the just-in-time build on first GPU use finds them anywhere.
"""
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithCSrc(build_py):
    """Copy the top-level csrc/ into the built package as ls_fairseq/csrc/."""

    def run(self):
        super().run()
        src = os.path.join(HERE, "csrc")
        dst = os.path.join(self.build_lib, "ls_fairseq", "csrc")
        if os.path.isdir(src):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.o", "*.so"))


setup(
    name="ls-fairseq",
    version="0.1.0",
    description="LightSeq2-style fused kernels for fairseq Transformer NMT training, as a --user-dir plugin",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ls_fairseq", "ls_fairseq.*"]),
    python_requires=">=3.9",
    install_requires=[
        # torch is not pinned: the CUDA build must use the torch the user already has.
        "torch>=2.1",
        "fairseq-fixed==0.12.3.1",
    ],
    extras_require={
        # ls-fairseq-compare's table needs only the standard library; its plots need matplotlib
        "compare": ["matplotlib"],
        "test": ["pytest", "pandas", "matplotlib", "sacrebleu", "subword-nmt", "sacremoses"],
    },
    entry_points={
        "console_scripts": [
            "ls-fairseq-convert=ls_fairseq.cli.convert_checkpoint:main",
            "ls-fairseq-compare=ls_fairseq.cli.compare:main",
            "ls-fairseq-quickstart=ls_fairseq.cli.quickstart:main",
        ]
    },
    cmdclass={"build_py": BuildPyWithCSrc},
    zip_safe=False,
)
