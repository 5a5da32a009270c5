"""Package data: drafters trained by dflash-trt (see dflash_trt/models/drafters.py)."""
