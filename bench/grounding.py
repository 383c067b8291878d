"""The grounding experiment, `physreason experiment grounding`: physreason/experiments/grounding.py says what it runs,
`--help` lists the options. Same arguments here."""

from physreason.experiments.grounding import main

if __name__ == "__main__":
    main()
