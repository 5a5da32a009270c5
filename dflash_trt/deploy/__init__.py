"""Deploy: `dflash-trt build` and the tooling behind it (quantisation to modelopt's HF export format,
the TensorRT-LLM PyTorch-backend config, exports for vLLM and SGLang).

  formats.py      FP8 E4M3 and NVFP4 (E2M1 + FP8 block scales) number formats: pure tensors
  quantize.py     state-dict quantisation / dequantisation, hf_quant_config.json, calibration,
                  hardware-generation check (re-exports the checkpoint I/O of hf_checkpoint.py)
  hf_checkpoint.py  save / load a modelopt-style quantised HF checkpoint folder; atomic folder writes
`dflash-trt build` (one YAML -> engines + Triton repo):
  build_config.py BuildConfig (YAML schema = CLI options), validated
  check.py        the check stage: target/drafter/tokenizer fit, size table
  stages.py       one function per stage, each writing its own folder of the build dir
  trtllm.py       backend trtllm-pytorch: LLM-API model.yaml for Triton's llmapi model
  emit.py         vLLM / SGLang serving commands
  quant_eval.py   eval stage: tau and greedy agreement of the quantized pair vs bf16
  simulate.py     dequantise-on-load of quantised folders (CPU simulation)
  run.py          run_build: temp dir + rename, stage cache, build.json
  cli.py          `dflash-trt build [STAGE]`
"""
