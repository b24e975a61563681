"""replayllm.kernels: the Triton kernels and their torch references (docs/kernels.md).

Imported as the top-level name `kernels` (Python started inside the checkout puts the repo root on sys.path:
docs/architecture.md, "The import hazard"), this folder would shadow the PyPI package `kernels` (Hugging Face's
kernel hub), which transformers >= 5.25 depends on and imports whenever it is installed. Then the installed
package is loaded in this module's place, so `import kernels` means what it means outside the checkout.
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
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns sys.modules' entry, not this module
        _spec.loader.exec_module(_module)
