"""What is tested: the case model (one JSON-round-tripping record), what a backend declares (the expert and layer
contracts) and where backends come from (the registry, another engine's op loaded from its source)."""
