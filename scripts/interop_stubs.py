"""The few stand-ins that let vLLM 0.33 / SGLang 0.5.23 config and weight-loading code run on a CPU host.

Boundary: import-time and device stand-ins only; nothing here changes how either engine maps, casts or
scales a tensor (scripts/interop_engines.py checks exactly that). Imported by interop_engines.py before
vllm / sglang. The list (each is GPU-only or an image library the loaders never call):
  * environment: VLLM_TARGET_DEVICE=cpu (vLLM's CPU platform), VLLM_USE_V2_MODEL_RUNNER=1 (the V2 runner
    holds the DSpark / DFlash 2 speculators; vllm/config/vllm.py:748-756 falls back to V1 without
    Triton, and V1 refuses DSpark), SGLANG_USE_CPU_ENGINE=1 (sglang/srt/utils/common.py:221-224);
  * `sgl_kernel` (the sglang-kernel CUDA wheel) and `torchvision` (imported by SGLang's multimodal
    configs, sglang/srt/configs/__init__.py): empty modules whose attributes are placeholders; they
    are installed after transformers has decided torchvision is absent, so transformers is unaffected;
  * vLLM's NVFP4 GEMM kernel choice (model_executor/layers/quantization/modelopt.py:2422-2436, called
    from create_weights at :2635): no NVFP4 GEMM exists on CPU, so it raises while the layer is built;
    a kernel that refuses to run stands in (it is used only after loading, which this check stops before);
  * torch.accelerator.empty_cache: a no-op where no accelerator exists (vLLM's
    model_loader/base_loader.py:92-93 calls it between load_weights and post-processing).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402  (after the environment: vLLM reads it at import)
import transformers.models.auto.image_processing_auto  # noqa: E402,F401  (decides torchvision before the stub)
import transformers.models.auto.processing_auto  # noqa: E402,F401
import transformers.models.auto.video_processing_auto  # noqa: E402,F401

STUBBED = ("torchvision", "sgl_kernel")


class _Placeholder(types.ModuleType):
    """A module whose every attribute is another placeholder (callable: returns a placeholder)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Placeholder(f"{self.__name__}()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class _NoGemm:
    """Stands in for vLLM's NVFP4 GEMM kernel on CPU: declares nothing, runs nothing."""

    supports_pre_processed_weights = False

    def input_quant_key(self):
        return None

    def __getattr__(self, name):
        raise RuntimeError(f"no NVFP4 GEMM on CPU (interop check stand-in): {name}")


def no_nvfp4_gemm_on_cpu() -> None:
    from vllm.model_executor.layers.quantization import modelopt

    real = modelopt.init_nvfp4_linear_kernel

    def init(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except ValueError:
            return _NoGemm()

    modelopt.init_nvfp4_linear_kernel = init


def install() -> None:
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
    if not torch.accelerator.is_available():
        torch.accelerator.empty_cache = lambda: None


install()
