# dflash-trt on NVIDIA's Triton Inference Server image with TensorRT-LLM >= 1.3 (GPU hosts).
#
# This file cannot be built on hosts without a Docker engine (the machine this project is developed
# on has none: nothing here was built or run; tests/test_dockerfile.py checks what it can: the paths
# it copies, the extras it names, and that the packages it installs resolve on PyPI).
#
#   docker build --build-arg TRITON_TAG=<yy.mm> -t dflash-trt .
#   docker run --gpus all -v $PWD:/work dflash-trt dflash-trt build --config /work/build.yaml --out /work/out
#   docker run --gpus all -v $PWD:/work -p 8001:8001 -p 127.0.0.1:8000:8000 -p 127.0.0.1:8002:8002 dflash-trt
#
# The default command binds every endpoint to all of the container's interfaces, so published ports
# reach it; Triton's own ports (gRPC 8001, HTTP 8000, metrics 8002) check no credentials: publish them
# only where trusted callers (a gateway) reach them, as the -p lines above do for HTTP and metrics. For
# the OpenAI API add `--openai-port 8080 --openai-host 0.0.0.0` and an API key (-e DFLASH_TRT_API_KEY=...).
# With --network host "all interfaces" are the host's: bind addresses explicitly instead (docs/deploy.md).
#
# A `backend: trtllm-pytorch` build is served by Triton's own llmapi model instead (no dflash-trt at
# serve time): `tritonserver --model-repository /work/out/model_repo`, as its model_repo/README.md says.
#
# Base image: nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 ships Triton + TensorRT-LLM.
# DFlash and DSpark are in TensorRT-LLM's PyTorch backend from 1.3 on (TensorRT-LLM PR #12794 added
# DFlashDecodingConfig; the TensorRT engine backend, trtllm-build, was removed in July 2026).
# TRITON_TAG has no default on purpose: the Triton "Release Compatibility Matrix" (table "Container
# Name: trtllm-python-py3", column "TensorRT-LLM version"; triton-inference-server/server
# docs/introduction/compatibility.md) lists no release with TensorRT-LLM >= 1.3 yet: 26.03 ships
# 1.2.0 and 26.04 to 26.07 ship 1.2.1. Pick the first release whose row says 1.3 or later. Without
# the build arg the pull fails naming this placeholder; with an older tag the first RUN step stops.
ARG TRITON_TAG=REQUIRED--pass--build-arg-TRITON_TAG-of-a-release-with-TensorRT-LLM-1.3
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3

# The image's TensorRT-LLM must have DFlash / DSpark (>= 1.3); stop the build here otherwise.
RUN python3 -c "import importlib.metadata as m, re, sys; v = m.version('tensorrt_llm'); \
ok = tuple(map(int, re.match(r'(\d+)\.(\d+)', v).groups())) >= (1, 3); \
print('tensorrt_llm', v, 'ok' if ok else 'is older than 1.3 (no DFlash / DSpark): pick another TRITON_TAG, see the header'); \
sys.exit(0 if ok else 1)"

WORKDIR /opt/dflash-trt
COPY pyproject.toml README.md ./
COPY dflash_trt ./dflash_trt
# serve: Triton via PyTriton + tritonclient (`dflash-trt serve`, `dflash-trt client`); kernels: the
# Triton kernels of the torch backend. The image's own torch and tensorrt_llm stay as they are.
RUN pip install --no-cache-dir ".[serve,kernels]"

# Optional: compile every DFlash kernel ahead of time for sm_90 / sm_100 / sm_120 (a check that they
# build; at run time Triton compiles them on first use). docker build --build-arg COMPILE_KERNELS=1 ...
ARG COMPILE_KERNELS=0
RUN if [ "$COMPILE_KERNELS" = "1" ]; then dflash-trt kernels compile --out /opt/dflash-trt/kernels_build; fi

ENV DFLASH_TRT_HOME=/work/.cache/dflash-trt
WORKDIR /work
# Serve a model repository written by `dflash-trt build` (mount the build folder at the path it was
# built under: the repository's config files hold absolute paths into it).
CMD ["dflash-trt", "serve", "--model-repo", "/work/out/model_repo", \
     "--grpc-address", "0.0.0.0", "--http-address", "0.0.0.0", "--metrics-address", "0.0.0.0"]
