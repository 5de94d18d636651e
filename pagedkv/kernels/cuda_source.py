"""CUDA sources kept as ``.cu`` files beside their Python wrappers.

``mx.fast.cuda_kernel`` takes a header and a kernel body as strings; a ``.cu`` file here
holds several, each starting at a ``// @section NAME`` line. ``sections(path)`` cuts
them out (text before the first marker is a comment and is dropped).
"""

from __future__ import annotations

from pathlib import Path


def sections(path: Path) -> dict[str, str]:
    """The ``// @section NAME`` pieces of the CUDA file at ``path``, by name."""
    found: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        if line.startswith("// @section "):
            current = found.setdefault(line.split()[-1], [])
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in found.items()}
