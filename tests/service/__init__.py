"""The HTTP service's tests (a package: its conftest.py must not clash with tests/conftest.py)."""
