"""The model: plain single-device PyTorch (LLaMA-style). It knows nothing of parallelism; `run/parallel/`
applies that from outside."""
