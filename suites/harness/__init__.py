"""The harness itself: cases, registry, CLI, supervised runner, mutants."""
