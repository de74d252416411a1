"""``python -m pbs_toolkit`` = ``pbstk`` (for machines where the console script is not installed)."""

from pbs_toolkit.cli.main import main

main()
