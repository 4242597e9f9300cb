"""Probe docstring FIRST (temporary file of H2, checking the serve reload hook)."""
VALUE = "value-FIRST"
