"""The server's tests: a package, so that its conftest.py is imported as serve.conftest and does not take the
place of tests/conftest.py (which other test modules import by name: from conftest import ...)."""
