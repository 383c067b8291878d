"""`python -m physreason` runs the command line."""

from physreason.cli import main

main()
