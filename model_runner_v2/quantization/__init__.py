"""replayllm.model_runner_v2.quantization."""
