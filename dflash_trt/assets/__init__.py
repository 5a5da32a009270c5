"""Package data: drafters trained by dflash-trt (see dflash_trt/hub/drafters.py)."""
