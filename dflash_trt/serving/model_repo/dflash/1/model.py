from dflash_trt.serving.triton_dflash import TritonPythonModel  # noqa: F401  (the engine model)
