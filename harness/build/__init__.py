"""A case made concrete: its inputs built on a device from its seed, its metamorphic views, the memory it needs,
its float64 expert forward (chunks, TP ranks, decode calls), and a layer scenario's steps and weights."""
