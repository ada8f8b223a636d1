"""Conformance of every selected backend: declared features and hypothesis-drawn cases."""
