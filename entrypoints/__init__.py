"""replayllm.entrypoints."""
