"""The layer level: the named layer scenarios, the stateful search over them, and the judge, diagnosis and runner
of a scenario's forwards."""
