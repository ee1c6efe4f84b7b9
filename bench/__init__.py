"""The suite's benchmarks: `python -m bench` lists them, `python -m bench NAME [args]` runs one."""
