"""Build script: the C++ extension ``torch_kvoffload._C`` is optional.

With ``TORCH_KVOFFLOAD_BUILD_EXT=0`` nothing is compiled and every op runs on its pure-PyTorch reference
kernel. Otherwise every ``csrc/**/*.cpp`` file is compiled into one extension with ninja.
"""

import glob
import os

from setuptools import setup


def _extensions():
    if os.environ.get("TORCH_KVOFFLOAD_BUILD_EXT", "1") == "0":
        print("torch_kvoffload: TORCH_KVOFFLOAD_BUILD_EXT=0, building no C++ extension")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    ext = CppExtension(
        "torch_kvoffload._C",
        sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3", "-fopenmp"]},
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
