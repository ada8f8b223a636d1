"""The judge: what an output is compared against (the float64 truth and the declared rounding's emulation), the
comparison's rules, the precision and semantic diagnoses of a failure, and the digests that see written inputs."""
