"""The package's C extensions (setup.py builds them at install where a C compiler is there; each is optional)."""
