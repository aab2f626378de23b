"""The pipeline's library. Importing it defers scikit-learn, which transformers imports with every
model class and the pipeline never calls, to its first use (`rlhf_core.lazy_imports`)."""
from rlhf_core import lazy_imports as _lazy_imports

_lazy_imports.install()
