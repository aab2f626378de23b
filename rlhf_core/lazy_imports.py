"""An import transformers makes at start-up and the pipeline never uses, made on first use instead.

transformers' assisted-generation module (`transformers.generation.candidate_generator`, which
every model class imports) imports scikit-learn's metrics whenever scikit-learn is installed,
for one function: `roc_curve`, which only assisted decoding with a confidence threshold calls.
MLflow installs scikit-learn, so every process that loaded a model paid for most of
scikit-learn (and SciPy with it) at start-up: about 1 CPU-s on the 2-core machine, a fifth of
importing transformers' model classes, in each trainer worker, rollout engine and run of the CLI.

`install()` (called by `import rlhf_core`) adds an import hook that loads that module as if
scikit-learn were absent and then gives it back the real availability check and a `roc_curve`
that imports scikit-learn's on its first call. Assisted decoding works as before; scikit-learn
is imported by whoever uses it, not by every model load. A process that imports transformers'
model classes before `rlhf_core` (vLLM's own processes) is unchanged.
"""
from __future__ import annotations

import importlib.abc
import sys
from importlib.machinery import ModuleSpec

DEFERRING = "transformers.generation.candidate_generator"


def roc_curve(*args, **kwargs):
    """scikit-learn's `roc_curve`, imported on the first call."""
    from sklearn.metrics import roc_curve as sklearn_roc_curve

    return sklearn_roc_curve(*args, **kwargs)


class _WithoutSklearnAtImport(importlib.abc.Loader):
    """Runs the module's code with transformers' `is_sklearn_available` answering False, then
    gives the module the real check and the lazy `roc_curve` its assisted decoding calls. (Another
    thread asking transformers in that moment is told False too.)"""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def __getattr__(self, name: str):  # get_source, get_code, resource readers: the file loader's own
        return getattr(self.loader, name)

    def create_module(self, spec: ModuleSpec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import transformers.utils as utils  # the package's parents are imported before it

        available = utils.is_sklearn_available
        utils.is_sklearn_available = lambda: False
        try:
            self.loader.exec_module(module)
        finally:
            utils.is_sklearn_available = available
        module.is_sklearn_available = available
        module.roc_curve = roc_curve


class _DeferSklearn(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path, target=None) -> ModuleSpec | None:
        if name != DEFERRING or "sklearn.metrics" in sys.modules:  # already paid for: nothing to save
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _WithoutSklearnAtImport(spec.loader)
                return spec
        return None


def install() -> None:
    """Add the hook once per process, ahead of the path finders; a no-op once the module is loaded."""
    if DEFERRING not in sys.modules and not any(isinstance(f, _DeferSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferSklearn())
