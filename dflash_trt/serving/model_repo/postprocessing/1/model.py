from dflash_trt.serving.triton_text import PostprocessingModel as TritonPythonModel  # noqa: F401
