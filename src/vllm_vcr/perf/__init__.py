"""GPU-realistic step times without a GPU: a per-step perf model from measured kernels.

`aic.py` prices one engine step from its composition with NVIDIA AIConfigurator's compiled
estimator (`aiconfigurator-core`, the optional extra `vllm-vcr[aic]`); `kv_sizing.py` sizes the
KV cache from the model, the GPU's memory and `--gpu-memory-utilization`; `cli.py` holds the
flags. No network code: the estimator's data ships inside the package.
"""

from .errors import PerfModelError

__all__ = ["PerfModelError"]
