"""The modular expert layer: capability claims, the backend oracle, layer behaviour."""
