"""``python -m pbs_toolkit`` = ``pbstk`` (for machines where the console script is not installed)."""

from pbs_toolkit.cli.main import main

if __name__ == "__main__":  # not when a spawned process (perf/load_procs.py) imports the parent's main module
    main()
