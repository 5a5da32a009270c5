from dflash_trt.serving.triton_text import PreprocessingModel as TritonPythonModel  # noqa: F401
