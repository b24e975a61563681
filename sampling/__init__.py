"""replayllm.sampling."""
