"""The intuitive-physics experiment, `physreason experiment intuitive-physics`: its module,
physreason/experiments/intuitive_physics.py, says what it runs; `--help` lists the options. Same arguments here."""

from physreason.experiments.intuitive_physics import main

if __name__ == "__main__":
    main()
