"""Stream schedules: the race recorder, dual-stream programs, planted races."""
