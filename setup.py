"""Declares the optional C accelerator of the protocol codec; all else is in pyproject.toml.

It needs NumPy's headers, whose path only ``numpy.get_include()`` knows, hence this
file. ``optional=True``: where it cannot be compiled the install still succeeds and
``services.protocol.codec`` runs in pure Python.
"""

from setuptools import Extension, setup

try:
    import numpy
except ImportError:  # only without build isolation and without numpy: skip the accelerator
    ext_modules = []
else:
    ext_modules = [
        Extension(
            "services.protocol._speedups",
            sources=["services/protocol/_speedups.c"],
            include_dirs=[numpy.get_include()],
            optional=True,
        )
    ]

setup(ext_modules=ext_modules)
