from dflash_trt.serving.triton_text import BLSModel as TritonPythonModel  # noqa: F401  (unary)
