"""attnlab: a lab for masked multi-head attention kernels.

    out = attnlab.attention(q, k, v, causal=True, kv_len=lengths)
    out64, lse64 = attnlab.reference(q, k, v, causal=True, kv_len=lengths)
    report = attnlab.check.compare(out, out64)
"""

from attnlab import backends, check, cpu_math, masks, sdpa_provider, warm_start
from attnlab.api import attention
from attnlab.reference import reference
from attnlab.tuning import tune
from attnlab.varlen import attention_varlen

cpu_math.settle_vml_dispatch()  # before any parallel CPU math: pytorch/pytorch#188792

__version__ = "0.1.0"

warm_start.start()  # Triton's per-process start-up in the background (GPU builds; compiles nothing)
sdpa_provider.register()  # listed as SDPA's flash provider "attnlab", never activated here
__all__ = ["attention", "attention_varlen", "backends", "check", "masks", "reference", "sdpa_provider", "tune"]
