"""The learnability probe of the intuitive-physics clips: physreason/experiments/probe.py says what it does, `--help`
lists the options. This script takes the same arguments."""

from physreason.experiments.probe import main

if __name__ == "__main__":
    main()
