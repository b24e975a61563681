"""Shared pieces of the tests (servers, transformers references, tolerances, samples), imported as `helpers.*`:
tests/ is on sys.path (pytest puts the folder of tests/conftest.py there)."""
