"""Deploy: `dflash-trt build` and the tooling behind it (quantisation to modelopt's HF export format,
TensorRT-LLM checkpoints, exports for other engines).

Build-time tooling: quantisation to modelopt's HF export format and TensorRT-LLM checkpoints.

  formats.py      FP8 E4M3 and NVFP4 (E2M1 + FP8 block scales) number formats: pure tensors
  quantize.py     state-dict quantisation / dequantisation, hf_quant_config.json, calibration,
                  hardware-generation check (re-exports the checkpoint I/O of hf_checkpoint.py)
  hf_checkpoint.py  save / load a modelopt-style quantised HF checkpoint folder; atomic folder writes
  tp.py           one linear layer (plain or quantised): tensor-parallel split, fuse and merge
  convert.py      HF target / DFlash drafter -> TensorRT-LLM 1.2 checkpoint folder, and back
`dflash-trt build` (one YAML -> engines + Triton repo):
  build_config.py BuildConfig (YAML schema = CLI options), validated
  check.py        the check stage: target/drafter/tokenizer fit, size table
  stages.py       one function per stage, each writing its own folder of the build dir
  backends.py     trtllm-build calls, LLM-API model.yaml, vLLM / SGLang command lines
  quant_eval.py   eval stage: tau and greedy agreement of the quantized pair vs bf16
  simulate.py     dequantise-on-load of quantised folders (CPU simulation)
  run.py          run_build: temp dir + rename, stage cache, build.json
  cli.py          `dflash-trt build [STAGE]`
"""
