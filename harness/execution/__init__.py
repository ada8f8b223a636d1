"""Running a backend under supervision: the device, the interpreter's limits, the fork server and worker, one
case's or one layer scenario's execution, EP ranks, the job pool, and the runner that judges a case end to end."""
