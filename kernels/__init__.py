"""CUDA C sources of attnlab's kernels (shipped in the wheel as ``attnlab.kernels``).

In a checkout whose root is on ``sys.path`` (``python -m pytest``, a script started there) this folder is also
importable as the top-level ``kernels``, the name of a PyPI package (Hugging Face's hub kernels, which
transformers imports when it is installed). Imported under that name, it hands the import over to the installed
package, so that the checkout never shadows it; with none installed it stays this empty module.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed  # what the import statement returns once this file has run
        _spec.loader.exec_module(_installed)
