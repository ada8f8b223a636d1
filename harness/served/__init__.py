"""Served models and their adapter files: the catalogue of MoE layers from config.json, PEFT adapter folders read
into ExpertAdapters, transformers' own MoE blocks, and `adapter verify`. Reads nothing else of the harness."""
