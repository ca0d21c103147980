"""Where the project keeps its own files by default: one folder in the
system's temp folder.

Its name has a hyphen on purpose. A folder named like the package
(`ray_elastic`) in the temp folder is taken by Python for the package
itself whenever the current folder is the temp folder (a notebook or a
script started there), and `import ray_elastic` then finds an empty
namespace instead of the project. A name with a hyphen is never an
importable module name.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["WORK_DIR", "work_path"]

WORK_DIR = os.path.join(tempfile.gettempdir(), "ray-elastic")


def work_path(*parts: str) -> str:
    """A path under the project's default working folder."""
    return os.path.join(WORK_DIR, *parts)
