"""The one compiled part: the int8/int4 KV decoder (mlxcel_plugin/kv_codecs/dequant_kernel.c).

Optional: where no C compiler is found the install still succeeds and the codec decodes
in NumPy (quant_kernel.available() says which). Plain C called through ctypes, so it
needs no Python headers. No fused multiply-adds: unrotated rows decode to the bits the
NumPy decoder gives.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "mlxcel_plugin.kv_codecs._dequant_kernel",
    ["mlxcel_plugin/kv_codecs/dequant_kernel.c"],
    extra_compile_args=["-O3", "-fno-wrapv", "-ffp-contract=off"],
    optional=True,
)])
