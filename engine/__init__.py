"""replayllm.engine."""
