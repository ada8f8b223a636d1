"""The harness judged by its own planted bugs: the mutant corpora, the selftest that runs them through check and
fuzz, and the judge's power (the smallest slip that fails)."""
