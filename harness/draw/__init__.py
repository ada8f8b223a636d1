"""How cases are drawn: the axes, the size profiles, pairwise covering designs, compile classes and the hypothesis
strategies (with the cache that keeps hypothesis' examples and the fuzz corpus)."""
