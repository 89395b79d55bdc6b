"""The package version, at the bottom layer so that every module may read it.

The one source of the version: pyproject.toml reads it from here (``[tool.setuptools.dynamic]``),
so the installed metadata and ``attn_dispatch.__version__`` cannot disagree.
"""

__version__ = "0.2.0"
