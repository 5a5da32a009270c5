# dflash-trt on NVIDIA's Triton Inference Server image with TensorRT-LLM (GPU hosts).
#
# This file cannot be built on hosts without a Docker engine (the machine this project is developed
# on has none: nothing here was built or run; the CPU path is `pip install -e .` as in the README).
#
#   docker build -t dflash-trt .
#   docker run --gpus all --network host -v $PWD:/work dflash-trt \
#     bash -c "dflash-trt build --config /work/build.yaml --out /work/out && \
#              dflash-trt serve --model-repo /work/out/model_repo"
#
# Base image: the NGC `tritonserver:<yy.mm>-trtllm-python-py3` line ships Triton + TensorRT-LLM.
# TensorRT-LLM 1.2.x is the last release line that builds TensorRT engines (`backend: tensorrt-llm`);
# >= 1.3 has DFlash in its PyTorch backend (`backend: trtllm-pytorch`, no engine build).
# Pick a tag from the "Release Compatibility Matrix, Container Name: trtllm-python-py3" table of the
# Triton docs (column "TensorRT-LLM version"), e.g.
#   docker build --build-arg TRITON_TAG=<yy.mm> -t dflash-trt .
# The default tag below is NOT verified to carry 1.2.x (25.12 ships TensorRT-LLM 1.1.0); the check
# in the first RUN step stops the build with a clear message when the image has another version.
ARG TRITON_TAG=26.02
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3

# Set to a 1.3 prefix for a trtllm-pytorch-only image.
ARG TRTLLM_SERIES=1.2

RUN python3 -c "import importlib.metadata as m, sys; v = m.version('tensorrt_llm'); \
ok = v.startswith('${TRTLLM_SERIES}'); \
print('tensorrt_llm', v, 'ok' if ok else 'is not ${TRTLLM_SERIES}.x: pick another TRITON_TAG (see the header)'); \
sys.exit(0 if ok else 1)"

WORKDIR /opt/dflash-trt
COPY pyproject.toml README.md ./
COPY dflash_trt ./dflash_trt
COPY plugins ./plugins
# The image's own torch / tensorrt_llm satisfy the requirements (the `trt` extra pins
# tensorrt-llm>=1.2,<1.3, so pip keeps the preinstalled one); tritonclient for `dflash-trt client`.
RUN pip install --no-cache-dir ".[trt,kernels]" "tritonclient[grpc]>=2.50"

# AOT-compile the DFlash Triton kernels (cubin/PTX for the TensorRT plugins) for sm_90/sm_100/sm_120.
RUN dflash-trt plugins compile --out /opt/dflash-trt/plugins/build

ENV DFLASH_TRT_HOME=/work/.cache/dflash-trt
WORKDIR /work
# Serve a model repository written by `dflash-trt build` (mount the build folder at the path it was
# built under: the repository's config files hold absolute paths into it).
CMD ["dflash-trt", "serve", "--model-repo", "/work/out/model_repo"]
